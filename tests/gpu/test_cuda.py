"""The engine on CUDA: every attention backend against the torch CPU float32 reference, the KV pool
in VRAM with exact block accounting, and a disaggregated request over NIXL between two GPU processes.

Skipped where there is no GPU. `PDSERVE_GPU_TEST_DEVICE=cpu` runs the same checks on the CPU (the
logic of this file, not the GPU path); tests/gpu/device_check.sh runs it on a lent GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from cluster.engine.config import kv_block_bytes
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.replay_timer import ReplayTimer
from cluster.tools.bench.ttft_tpot import SHAPES

DEVICE = os.environ.get("PDSERVE_GPU_TEST_DEVICE", "cuda")
REPORT = os.environ.get("PDSERVE_GPU_REPORT")  # a JSON-lines file the measured errors are appended to
REAL_MODEL = os.environ.get("PDSERVE_GPU_REAL_MODEL")  # a real checkpoint dir; else SmolLM2 when cached
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA")

# SmolLM2-135M-Instruct's shape (the embedded default), random weights; "real" is the real SmolLM2
# when it is in the cache (a GPU machine without network cannot fetch it) or PDSERVE_GPU_REAL_MODEL.
MODELS = {
    "gqa": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=320),
    "mha-wide": dict(layers=4, hidden=512, heads=4, kv_heads=4, vocab=1024),  # head_dim 128
    "smollm2-shape": SHAPES["smollm2-shape"],
}
PROMPTS = [[256] + [(7 * i + 3 * n) % 250 for i in range(n - 1)] for n in (5, 300, 700)]
SP = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BF16_REL_TOL = 5e-2  # ||logits - ref|| / ||ref|| per step, bf16 vs float32 (CPU bf16 measured 0.018 on SmolLM2)


def cuda_backends() -> list[str]:
    """Every attention backend this device runs (flash_attn only where it is installed)."""
    names = ["torch"]
    if DEVICE.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        names.append("flash_attn")
    return names


@pytest.fixture(scope="module")
def model_dirs(model_factory, request):
    out = {name: model_factory(name.replace("-", "_"), **kw) for name, kw in MODELS.items()}
    if REAL_MODEL:
        out["real"] = REAL_MODEL
    else:
        try:
            out["real"] = request.getfixturevalue("smollm2")
        except pytest.skip.Exception:
            pass
    return out


def _report(**row) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


# The static decode path (cluster/engine/static_decode.py): captured on CUDA, uncaptured on a CPU run.
STATIC = "graphs" if DEVICE.startswith("cuda") else "eager"


def run(model: str, device: str, dtype: str, backend: str, prompts=PROMPTS, static: str = "off"):
    """Greedy tokens per prompt, and per prompt the float32 CPU logits row of every sampled token."""
    eng = LLMEngine.from_model(model, device=device, dtype=dtype, attention_backend=backend, model_ops="torch",
                               block_size=256, num_blocks=16, max_num_batched_tokens=512, static_decode=static)
    rows: dict[str, list[torch.Tensor]] = {}
    orig = eng.runner.sampler.sample

    def capture(logits, reqs):
        cpu = logits.float().cpu().clone()  # the static path reuses its logits buffer every step
        for i, r in enumerate(reqs):
            rows.setdefault(r.request_id, []).append(cpu[i])
        return orig(logits, reqs)

    eng.runner.sampler.sample = capture
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, prompt_token_ids=p, sampling=SP)
    tokens = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids
    eng.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    if static != "off":  # every decode step took the static path; every row went back
        assert eng.runner.static.steps == max(len(t) for t in tokens.values()) - 1
        assert eng.runner.static._rows == {}
    return [tokens[r] for r in ids], [torch.stack(rows[r]) for r in ids]


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The torch CPU float32 run of each model (memoised)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run(model_dirs[name], "cpu", "float32", "torch")
        return cache[name]

    return get


MODEL_NAMES = [*MODELS, "real"]


@pytest.mark.parametrize("static", ["off", STATIC])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_float32_on_the_device_equals_the_cpu_reference(model_dirs, reference, name, static):
    """float32 on the device (TF32 off, torch's default): the same greedy tokens, logits to 1e-4;
    every step built dynamically, and decode steps on the static path (CUDA graphs on a GPU)."""
    if name not in model_dirs:
        pytest.skip("no real checkpoint: SmolLM2 is not in the cache and PDSERVE_GPU_REAL_MODEL is unset")
    ref_tokens, ref_logits = reference(name)
    tokens, logits = run(model_dirs[name], DEVICE, "float32", "torch", static=static)
    assert tokens == ref_tokens
    errs = [float((a - b).norm() / b.norm()) for got, ref in zip(logits, ref_logits) for a, b in zip(got, ref)]
    _report(test="float32", model=name, device=DEVICE, static=static, max_rel_err=max(errs))
    assert max(errs) < 1e-4


def test_static_decode_many_streams_equals_the_cpu_reference(model_dirs):
    """24 requests of 1 to 700 tokens in float32, decode steps replayed as graphs: buckets shrink
    as requests end (24 -> 16 -> ...), tables widen as contexts cross blocks; the same greedy tokens
    as the CPU's dynamic path, the pool whole after."""
    model = model_dirs["gqa"]
    prompts = [[256] + [(5 * i + 7 * n) % 250 for i in range(n - 1)] for n in
               (1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 400, 511, 512, 513, 600, 700)]
    sps = [SamplingParams(max_tokens=8 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(dtype="float32", attention_backend="torch", model_ops="torch", block_size=16, num_blocks=512,
              max_num_seqs=32, max_num_batched_tokens=8192)
    want = [o.token_ids for o in LLMEngine.from_model(model, device="cpu", static_decode="off", **kw).generate(prompts, sps)]
    eng = LLMEngine.from_model(model, device=DEVICE, static_decode=STATIC, **kw)
    static = eng.runner.static
    # replays timed from outside, as ttft_tpot does (a no-op on the eager path: no replays)
    with ReplayTimer(static) as timer:
        got = [o.token_ids for o in eng.generate(prompts, sps)]
    assert got == want
    assert static.steps >= 50 and static._rows == {}
    assert "_replay" not in vars(static)  # the timer is gone with its block
    if static.capture:
        assert len(static._graphs) >= 4
        assert len(timer.events) == static.steps  # one (rows, start, end) a captured step
    _report(test="static-many", device=DEVICE, static=STATIC, attention=static.attention,
            graphs=len(static._graphs), steps=static.steps)
    eng.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_async_output_streams_equal_the_synchronous_engines(model_dirs):
    """Async output (on by default with CUDA) over graph replays: a stop string, a seeded sampled
    request, logprobs, an abort, a failure and a deadline mid-stream give the streams of the
    synchronous engine, each decode delta one step late (tests/engine/test_static_decode.py)."""
    from tests.engine.test_static_decode import check_async_output

    check_async_output(model_dirs["gqa"], STATIC, device=DEVICE, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (32, 8), (8, 1)])
def test_paged_decode_kernel_equals_row_by_row(dtype, heads, kv_heads):
    """The static path's attention on this device (Triton on CUDA, else the torch reference) against
    a float64 row-by-row reference over each row's own keys."""
    from cluster.engine.attention.paged_decode import paged_decode_torch, paged_decode_triton, triton_available
    from tests.engine.test_static_decode import reference_decode

    fn = paged_decode_triton if DEVICE.startswith("cuda") and triton_available() else paged_decode_torch
    torch.manual_seed(heads + kv_heads)
    nb, bs, d = 64, 16, 64
    pool = torch.randn(nb, 2, 2, bs, kv_heads, d, dtype=getattr(torch, dtype), device=DEVICE)
    lens = torch.tensor([1, 15, 16, 17, 100, 333, 500, 2], dtype=torch.int32, device=DEVICE)
    tables = torch.randint(0, nb, (len(lens), 32), dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads, d, dtype=pool.dtype, device=DEVICE)
    got = fn(q, pool[:, 1, 0], pool[:, 1, 1], tables, lens, d**-0.5)
    ref = reference_decode(q.cpu().float(), pool[:, 1, 0].cpu().float(), pool[:, 1, 1].cpu().float(), tables.cpu(),
                           lens.cpu(), d**-0.5)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu().float(), ref, **tol)
    _report(test="paged-decode-kernel", device=DEVICE, kernel=fn.__name__, dtype=dtype, heads=heads, kv_heads=kv_heads,
            max_abs_err=float((got.cpu().float() - ref).abs().max()))


@pytest.mark.parametrize("static", ["off", STATIC])
@pytest.mark.parametrize("backend", cuda_backends())
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bfloat16_backends_track_the_cpu_reference(model_dirs, reference, name, backend, static):
    """bf16: each step's logits within BF16_REL_TOL of the float32 reference on the same inputs,
    and greedy tokens equal until a step whose reference top two are closer than the step's own
    error (a near tie bf16 may break either way; vLLM's tests allow the same)."""
    if name not in model_dirs:
        pytest.skip("no real checkpoint: SmolLM2 is not in the cache and PDSERVE_GPU_REAL_MODEL is unset")
    if static != "off" and backend != "torch":
        pytest.skip("the static path is the torch backend's")
    ref_tokens, ref_logits = reference(name)
    tokens, logits = run(model_dirs[name], DEVICE, "bfloat16", backend, static=static)
    matched, worst = 0, 0.0
    for got_t, ref_t, got_l, ref_l in zip(tokens, ref_tokens, logits, ref_logits):
        n = next((i for i, (a, b) in enumerate(zip(got_t, ref_t)) if a != b), len(ref_t))
        matched += n
        for i in range(min(n + 1, len(ref_t))):  # the inputs agree up to and including step n
            rel = float((got_l[i] - ref_l[i]).norm() / ref_l[i].norm())
            worst = max(worst, rel)
            assert rel < BF16_REL_TOL, f"step {i}: relative logits error {rel:.4f}"
        if n < len(ref_t):
            margin = float(ref_l[n][ref_t[n]] - ref_l[n][got_t[n]])
            err = float((got_l[n] - ref_l[n]).abs().max())
            assert margin <= 2 * err, f"step {n}: token {got_t[n]} over {ref_t[n]}, margin {margin:.4f} > 2 x {err:.4f}"
    _report(test="bfloat16", model=name, backend=backend, static=static, device=DEVICE, max_rel_err=worst,
            tokens_matched=matched, tokens=sum(map(len, ref_tokens)))


def test_kv_pool_lives_in_device_memory_with_exact_block_accounting(model_dirs):
    """The pool is one device tensor of num_blocks x the block's bytes; blocks are counted exactly
    through prefill, decode, a prefix hit and the end."""
    eng = LLMEngine.from_model(model_dirs["gqa"], device=DEVICE, dtype="bfloat16", block_size=16, num_blocks=64,
                               max_num_batched_tokens=2048)
    assert eng.kv_cache.device.type == torch.device(DEVICE).type and eng.kv_cache.is_contiguous()
    assert eng.kv_cache.nbytes == 64 * kv_block_bytes(eng.model_config, eng.config)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lens = (5, 40, 100)  # 1, 3 and 7 blocks of 16
    for i, n in enumerate(lens):
        eng.add_request(f"a{i}", prompt_token_ids=PROMPTS[2][:n], sampling=sp)
    eng.step()  # every prompt prefilled in one step, a first token each
    assert eng.kv.num_blocks - eng.kv.num_free_blocks == 1 + 3 + 7
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()
    assert eng.kv.num_free_blocks == 64  # cached prefix blocks count as free (evictable)
    # The 100-token prompt again: its 6 full blocks come from the prefix cache, one is computed.
    out = eng.generate([PROMPTS[2][:100]], sp)[0]
    assert out.num_cached_tokens == 96
    eng.check_invariants()
    assert eng.kv.num_free_blocks == 64


def test_disaggregated_request_over_nixl_between_device_processes(model_dirs, tmp_path):
    """A prefill engine in a child process and a decode engine here, both on the device: NIXL moves
    the blocks VRAM to VRAM (whatever UCX picks, logged by the transport), the tokens equal one
    engine's, and both pools end whole."""
    pytest.importorskip("nixl")
    from decode.engine import DecodeEngine
    from kv_transfer.layout import engine_layout
    from kv_transfer.metadata_store import FileMetadataStore
    from kv_transfer.transport import NixlTransport
    from cluster.tools.local_peer import PrefillProcess
    from tests.kv_transfer.test_kv_transfer import assert_pools_whole, run_disaggregated

    model = model_dirs["smollm2-shape"]
    kw = dict(device=DEVICE, dtype="bfloat16", num_blocks=96, max_num_batched_tokens=1024)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[256] + [(11 * i + n) % 250 for i in range(n - 1)] for n in (1, 16, 17, 300)]
    want = [o.token_ids for o in LLMEngine.from_model(model, **kw).generate(prompts, sp)]
    prefill = PrefillProcess(model, tmp_path, **kw)
    engine = LLMEngine.from_model(model, **kw)
    transport = NixlTransport("decode-gpu", engine.kv_cache, engine_layout(engine), FileMetadataStore(tmp_path))
    decode = DecodeEngine(engine, transport, transfer_timeout_s=10)
    try:
        assert transport.mem_type == ("VRAM" if DEVICE.startswith("cuda") else "DRAM")
        got, finals = run_disaggregated(prefill, decode, prompts, sp)
        assert got == want
        st = transport.stats
        assert st.pulls_ok == len(prompts) and st.fallbacks_recompute == 0
        assert st.blocks_pulled == sum(-(-len(p) // 16) for p in prompts)  # 1 + 1 + 2 + 19
        assert st.bytes_pulled == st.blocks_pulled * transport.block_bytes
        _report(test="nixl", device=DEVICE, mem_type=transport.mem_type, blocks=st.blocks_pulled,
                bytes=st.bytes_pulled, ucx_tls=os.environ.get("UCX_TLS", "(UCX's choice)"))
        assert_pools_whole(prefill, decode)
    finally:
        transport.close()
        prefill.close()


def test_sampling_on_the_device():
    """Unseeded rows draw on the device (an exponential race over the filtered distribution: one
    read of the ids); a seeded row draws on the host from its own generator, so its token equals the
    CPU's for the same logits."""
    from cluster.engine.request import Request
    from cluster.engine.sampler import Sampler

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = p.clamp_min(1e-30).log().repeat(4000, 1)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0, top_k=3)) for i in range(4000)]
    out = Sampler(0).sample(logits.to(DEVICE), reqs)
    counts = torch.bincount(torch.tensor(list(out.tokens.values())), minlength=5)
    want = p[:3] / p[:3].sum()
    sd = (want * (1 - want) / 4000).sqrt()
    assert counts[3] == 0 and counts[4] == 0 and ((counts[:3] / 4000 - want).abs() < 4 * sd).all(), counts.tolist()
    seeded = [Request(f"s{i}", [1, 2], SamplingParams(temperature=0.9, top_p=0.8, seed=i)) for i in range(8)]
    rows = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    on_device = Sampler(0).sample(rows.to(DEVICE), seeded).tokens
    assert on_device == Sampler(0).sample(rows, seeded).tokens
