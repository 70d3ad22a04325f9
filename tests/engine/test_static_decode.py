"""The static decode path (issue 40; cluster/engine/static_decode.py), run uncaptured on the CPU as
a GPU runs it captured: the same greedy tokens as the dynamic path and as transformers, with padded
buckets, tables that widen as contexts cross blocks, stop strings, aborts, preemption and sampled
requests beside greedy ones; the pool whole and every persistent row free afterwards; padding rows
write only the sink block past the pool's end."""

import dataclasses
import importlib.util
import os
import random
import time

import pytest
import torch

from cluster.engine.attention.paged_decode import paged_decode_torch
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.static_decode import batch_buckets, width_bucket
from tests.reference import hf_greedy

TORCH_PATH = dict(attention_backend="torch", model_ops="torch")


def prompts(lengths, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[256] + [rng.randrange(vocab) for _ in range(n - 1)] for n in lengths]


def pair(model, **kw):
    base = TORCH_PATH | dict(num_blocks=96, block_size=16, max_num_seqs=16) | kw
    return (LLMEngine.from_model(model, static_decode="off", **base),
            LLMEngine.from_model(model, static_decode="eager", **base))


def assert_whole(engine: LLMEngine):
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.num_requests() == 0
    static = engine.runner.static
    if static is not None:
        assert static._rows == {}
        assert sorted(static._free) == list(range(static.max_batch))


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """Row by row over the row's own keys, in float64: the meaning of paged decode attention."""
    out = torch.empty_like(q)
    bs, hkv, d = k_cache.shape[1:]
    group = q.shape[1] // hkv
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].double()
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].double()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, dim=0)
            out[b, h] = (w @ v[:, h // group]).to(q.dtype)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (4, 4), (8, 1)])
def test_paged_decode_torch_equals_row_by_row(heads, kv_heads):
    torch.manual_seed(heads * 10 + kv_heads)
    nb, layers, bs, d = 24, 3, 16, 32
    pool = torch.randn(nb, layers, 2, bs, kv_heads, d)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # a layer's strided view, as the model passes it
    lens = torch.tensor([1, 16, 17, 70, 5, 33], dtype=torch.int32)
    tables = torch.randint(0, nb, (len(lens), 5), dtype=torch.int32)  # past a row's blocks: any id
    q = torch.randn(len(lens), heads, d)
    got = paged_decode_torch(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(got, reference_decode(q, k_cache, v_cache, tables, lens, d**-0.5),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel runs on CUDA (tests/gpu) or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (8, 1)])
def test_paged_decode_triton_interpreted_equals_row_by_row(heads, kv_heads):
    from cluster.engine.attention.paged_decode import paged_decode_triton

    torch.manual_seed(heads)
    nb, bs, d = 24, 16, 64
    pool = torch.randn(nb, 2, 2, bs, kv_heads, d)
    lens = torch.tensor([1, 31, 70, 16], dtype=torch.int32)
    tables = torch.randint(0, nb, (4, 5), dtype=torch.int32)
    q = torch.randn(4, heads, d)
    got = paged_decode_triton(q, pool[:, 0, 0], pool[:, 0, 1], tables, lens, d**-0.5)
    torch.testing.assert_close(got, reference_decode(q, pool[:, 0, 0], pool[:, 0, 1], tables, lens, d**-0.5),
                               atol=2e-6, rtol=1e-5)


def test_buckets():
    assert batch_buckets(16) == (1, 2, 4, 8, 12, 16)
    assert batch_buckets(100) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert batch_buckets(1) == (1,)
    assert [width_bucket(n, 40) for n in (1, 2, 3, 4, 5, 8, 9, 33, 40)] == [1, 2, 4, 4, 8, 8, 16, 40, 40]


def test_static_steps_equal_dynamic_and_transformers(tiny_model):
    dynamic, static = pair(tiny_model)
    # 10 requests: bucket 12 (two padding rows); contexts from 1 to 95 tokens cross blocks while
    # decoding, so the table widens (1, 2, 4, 8 blocks) and rows gain blocks between steps.
    ps = prompts([1, 3, 9, 16, 17, 30, 33, 47, 64, 95], seed=1)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in dynamic.generate(ps, sp)]
    got = [o.token_ids for o in static.generate(ps, sp)]
    assert got == want
    for p, toks in zip(ps, got):
        assert toks == hf_greedy(tiny_model, p, 20), f"prompt of {len(p)} tokens"
    assert static.runner.static.steps >= 15  # the decode steps took the static path
    assert dynamic.runner.static is None
    assert_whole(static)
    assert_whole(dynamic)


def test_padding_rows_write_only_the_sink(tiny_model):
    _, static = pair(tiny_model, num_blocks=32)
    pool = static.runner.static.kv_pool
    assert static.kv_cache.shape[0] == 32 and pool.shape[0] == 33
    assert static.kv_cache.data_ptr() == pool.data_ptr()  # the accounted pool is the tensor's head
    before = pool.clone()
    # 3 requests: bucket 4, one padding row every step
    static.generate(prompts([5, 20, 40], seed=2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert not torch.equal(pool[32], before[32])  # the padding row wrote the sink
    assert static.kv.num_blocks == 32  # the sink is never accounted, so never allocated
    assert_whole(static)


def test_stop_strings_aborts_and_sampling_beside_greedy(tiny_model):
    dynamic, static = pair(tiny_model)
    ps = prompts([12, 25, 40, 7, 19], seed=3)
    first = dynamic.generate([ps[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = first.text[4:6]
    sps = [
        SamplingParams(max_tokens=20, temperature=0, stop=(stop,), ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    ]

    def run(engine):
        for i, (p, sp) in enumerate(zip(ps, sps)):
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
        outs: dict[str, list] = {}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
            steps += 1
            if steps == 6:  # r3 aborted mid-stream
                outs["r3"].append(engine.abort("r3"))
        # each output carries the tokens and text since the last: the whole stream, how it ended
        return {rid: ([t for o in os_ for t in o.token_ids], "".join(o.text for o in os_), os_[-1].finish_reason)
                for rid, os_ in outs.items()}

    want, got = run(dynamic), run(static)
    assert got == want
    assert want["r0"][2] == "stop" and want["r3"][2] == "cancelled"
    assert 0 < len(want["r3"][0]) < 20 and len(want["r4"][0]) == 20
    assert static.runner.static.steps > 0
    assert_whole(static)
    assert_whole(dynamic)


def test_preemption(tiny_model):
    ps = prompts([30, 45, 20, 60, 35, 50], seed=4)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    dynamic, static = pair(tiny_model, num_blocks=12, max_num_batched_tokens=64)
    want = [o.token_ids for o in dynamic.generate(ps, sp)]
    got = [o.token_ids for o in static.generate(ps, sp)]
    assert static.stats.preemptions > 0
    assert got == want
    assert got == [hf_greedy(tiny_model, p, 24) for p in ps]
    assert_whole(static)


def test_real_smollm2(smollm2):
    dynamic, static = pair(smollm2, num_blocks=64, max_num_seqs=8)
    ps = [dynamic.tokenizer.encode(t) for t in
          ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in dynamic.generate(ps, sp)]
    assert [o.token_ids for o in static.generate(ps, sp)] == want
    assert static.runner.static.steps >= 23
    assert_whole(static)


def test_options_refused():
    with pytest.raises(ValueError, match="model_ops torch"):
        EngineConfig(model="x", static_decode="eager", model_ops="cpu_kernels")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="x", static_decode="graphs", tensor_parallel_size=2)


def test_graphs_need_cuda(tiny_model):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA"):
        LLMEngine.from_model(tiny_model, static_decode="graphs", device="cpu", num_blocks=8)


def test_a_failed_capture_degrades_to_eager(tiny_model):
    """Graphs are captured on first use, mid-serving: a capture that raises (another thread's CUDA
    work invalidating it, say) leaves decode steps eager, with the same tokens, and fails no request."""
    dynamic, static = pair(tiny_model)
    st = static.runner.static

    def broken(key):
        raise RuntimeError("operation not permitted when stream is capturing")

    st.capture, st._capture = True, broken  # as on CUDA; the first static step tries to capture
    ps = prompts([5, 20, 33], seed=6)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in dynamic.generate(ps, sp)]
    outs = static.generate(ps, sp)
    assert [o.token_ids for o in outs] == want and {o.finish_reason for o in outs} == {"length"}
    assert st.capture is False and st.steps == 9
    assert_whole(static)


def test_fixed_width_tables_equal_dynamic(tiny_model):
    """The Triton path's layout (one graph per batch bucket): every step's table max_blocks wide on
    the device, the host sending only the columns in use, columns past them left from older rows.
    Run here with the torch reference (which reads every column, so stale ids must stay valid block
    ids): the same tokens as the dynamic path, across requests of very different lengths that
    reuse each other's rows."""
    from cluster.engine.static_decode import StaticDecode

    dynamic, static = pair(tiny_model, max_num_seqs=4)
    old = static.runner.static
    st = static.runner.static = StaticDecode(static.model, old.kv_pool, 16, 4, static.max_model_len,
                                             torch.device("cpu"), capture=False, fixed_width=True)
    ps = prompts([90, 3, 40, 2, 7, 65, 1, 30], seed=8)
    sps = [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0, ignore_eos=True) for i in range(len(ps))]
    want = [o.token_ids for o in dynamic.generate(ps, sps)]
    assert [o.token_ids for o in static.generate(ps, sps)] == want
    assert st._fixed.shape == (4, 2 + st.max_blocks) and st.steps > 20
    assert_whole(static)


# ---- async output (EngineOptions.async_output): a decode step's deltas emitted by the next step ----


@pytest.mark.parametrize("static_decode", ["off", "eager"])
def test_async_output_streams_equal_the_synchronous_engines(tiny_model, static_decode):
    """Every stream equals the synchronous engine's (tokens, text, finish reason, logprobs) with a
    stop string, a seeded sampled request, logprobs, an abort, a failure and a deadline mid-stream;
    a decode step's deltas arrive exactly one step late (first tokens and terminal outputs never);
    the deferred ones are emitted after the next forward is launched and before its sampler reads."""
    check_async_output(tiny_model, static_decode)


def check_async_output(model: str, static_decode: str, **kw):
    """The test above on any device (tests/gpu runs it with CUDA graphs)."""
    base = TORCH_PATH | dict(num_blocks=96, block_size=16, max_num_seqs=16) | kw
    sync = LLMEngine.from_model(model, static_decode=static_decode, async_output="off", **base)
    deferring = LLMEngine.from_model(model, static_decode=static_decode, async_output="on", **base)
    assert (sync.async_output, deferring.async_output) == (False, True)
    ps = prompts([12, 25, 40, 7, 19, 30, 9], seed=11)
    first = sync.generate([ps[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    sps = [
        SamplingParams(max_tokens=20, temperature=0, stop=(first.text[4:6],), ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    ]

    def run(engine):
        for i, (p, sp) in enumerate(zip(ps, sps)):
            engine.add(engine.make_request(f"r{i}", None, p, sp, RequestContext(deadline=time.time() + 3600)))
        outs: dict[str, list] = {}
        arrivals: dict[str, list[int]] = {}  # per request, the step each of its tokens came out
        steps = 0
        while engine.has_unfinished():
            steps += 1
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
                arrivals.setdefault(o.request_id, []).extend([steps] * len(o.token_ids))
            if steps == 6:  # mid-stream: an abort and an error; a deadline passes before the next step
                outs["r3"].append(engine.abort("r3"))
                outs["r5"].append(engine.fail("r5", "injected"))
                req6 = engine.scheduler.running[[r.request_id for r in engine.scheduler.running].index("r6")]
                req6.ctx = dataclasses.replace(req6.ctx, deadline=time.time() - 1)
        streams = {rid: ([t for o in os_ for t in o.token_ids], "".join(o.text for o in os_), os_[-1].finish_reason,
                         [lp for o in os_ for lp in (o.logprobs or [])]) for rid, os_ in outs.items()}
        return streams, arrivals

    order: list[tuple[str, int]] = []  # ("emit" | "sample", static steps launched so far)
    static = deferring.runner.static
    launched = (lambda: static.steps) if static is not None else (lambda: deferring.stats.steps)
    emit, sample = deferring.output_processor.emit, deferring.runner.sampler.sample
    deferring.output_processor.emit = lambda items: order.append(("emit", launched())) or emit(items)
    deferring.runner.sampler.sample = lambda *a: order.append(("sample", launched())) or sample(*a)

    want, sync_steps = run(sync)
    got, async_steps = run(deferring)
    assert got == want
    assert [want[r][2] for r in ("r0", "r3", "r4", "r5", "r6")] == ["stop", "cancelled", "length", "error", "deadline"]
    assert 0 < len(want["r3"][0]) < 20 and 0 < len(want["r6"][0]) < 20 and len(want["r2"][3]) == 20
    # r4 (greedy, 20 tokens): first token at once, then each decode's one step late, the last at once
    s = sync_steps["r4"]
    assert s == list(range(s[0], s[0] + 20))
    assert async_steps["r4"] == [s[0]] + [t + 1 for t in s[1:19]] + [s[19]]
    assert async_steps["r0"] == sync_steps["r0"]  # a stop string's request: never deferred
    # every deferred delta went out inside a step, after its forward launched, before its sampler
    # (an abort, a failure or an expiry emits its request's deferred delta at once: not in a step)
    in_step = [i for i, (what, n) in enumerate(order)
               if what == "emit" and i + 1 < len(order) and order[i + 1] == ("sample", n)]
    assert len(in_step) >= 15
    assert all(order[i - 1] != ("sample", order[i][1]) for i in in_step)  # the step's sampler had not read yet
    assert deferring._deferred == []
    assert_whole(deferring)
    assert_whole(sync)


def test_async_output_default_is_cuda_only(tiny_model):
    engine = LLMEngine.from_model(tiny_model, device="cpu", num_blocks=8)
    assert engine.config.async_output == "auto" and engine.async_output is False
