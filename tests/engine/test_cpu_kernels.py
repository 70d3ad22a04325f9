"""The compiled CPU kernels equal plain torch (the reference): the paged decode attention against
the torch backend, the small-batch linear and RMSNorm against torch's, op by op and end to end."""

import random

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.attention import AttentionMetadata, PrefillSpan, resolve_backend
from cluster.engine.kernels.cpu import KernelUnavailable, load
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.ops import FUSED_MAX_CHUNK, ROW_PAD, SMALL_ROWS, CPUKernelOps, TorchOps
from cluster.engine.model.rope import RotaryEmbedding
from cluster.engine.sampling_params import SamplingParams

try:
    load()
except KernelUnavailable as e:  # no C++ compiler here: the torch backend is what auto picks
    pytest.skip(f"CPU kernels unavailable: {e}", allow_module_level=True)

BS, H, HKV, D, LAYERS, BLOCKS = 16, 6, 2, 32, 3, 64


def step_metadata(decode_lens, prefill, rng, bs=BS):
    """Decodes (one token each, context `decode_lens`, longest first) then one prefill chunk
    (start, q_len); each request's blocks are random distinct pool blocks."""
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    ctxs = list(decode_lens) + ([prefill[0] + prefill[1]] if prefill else [])
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctxs]
    slot_b, slot_o = [], []
    for i, c in enumerate(ctxs):
        first = c - 1 if i < len(decode_lens) else prefill[0]
        for pos in range(first, c):
            slot_b.append(tables[i][pos // bs])
            slot_o.append(pos % bs)
    width = max(len(t) for t in tables)
    spans = ()
    if prefill:
        start, q_len = prefill
        mask = None
        if start > 0:
            mask = torch.arange(start + q_len)[None, :] <= torch.arange(start, start + q_len)[:, None]
        spans = (PrefillSpan(len(decode_lens), q_len, start + q_len, torch.tensor(tables[-1]), mask),)
    q_lens = [1] * len(decode_lens) + ([prefill[1]] if prefill else [])
    return AttentionMetadata(
        slot_blocks=torch.tensor(slot_b), slot_offsets=torch.tensor(slot_o), num_decode=len(decode_lens),
        prefills=spans, cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_q_len=max(q_lens), max_seq_len=max(ctxs), block_size=bs)


@pytest.mark.parametrize("decode_lens,prefill", [
    ([1], None), ([16], None), ([17], None), ([200, 120, 33, 16, 5, 1], None),
    ([200, 120, 90, 64, 33, 17, 16, 5, 1], None),  # 4 x 2 threads or more: a whole request per work item
    ([90, 40], (32, 20)), ([], (0, 40)), ([64], (0, 9)),
])
def test_cpu_paged_equals_the_torch_backend(decode_lens, prefill):
    rng = random.Random(len(decode_lens))
    torch.manual_seed(0)
    meta = step_metadata(decode_lens, prefill, rng)
    t = len(meta.slot_blocks)
    pool = torch.randn(BLOCKS, LAYERS, 2, BS, HKV, D)
    q, k, v = torch.randn(t, H, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    outs = []
    for name in ("torch", "cpu_paged"):
        backend = resolve_backend(name, torch.device("cpu"), BS)
        cache = pool.clone()
        kc, vc = cache[:, 1, 0], cache[:, 1, 1]  # a middle layer: strided views, as the model passes them
        backend.write_kv(kc, vc, k, v, meta)
        outs.append((backend.attend(q, k, v, kc, vc, meta, D**-0.5), cache))
    (ref, ref_cache), (got, got_cache) = outs
    assert torch.equal(got_cache, ref_cache)  # the same slots written, nothing else touched
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h, hkv, d", [(34, 2, 20), (8, 1, 8), (3, 3, 36)])  # 17 heads a KV head; MQA; D off the vector width
def test_cpu_paged_takes_any_head_grouping_and_head_size(h, hkv, d):
    meta = step_metadata([70, 33, 1], None, random.Random(h))
    g = torch.Generator().manual_seed(d)
    pool = torch.randn(BLOCKS, 1, 2, BS, hkv, d, generator=g)
    q = torch.randn(3, h, d, generator=g)
    outs = [resolve_backend(name, torch.device("cpu"), BS).attend(q, None, None, pool[:, 0, 0], pool[:, 0, 1], meta,
                                                                   d**-0.5)
            for name in ("torch", "cpu_paged")]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h, hkv, d, bs", [(9, 3, 64, 16), (12, 4, 128, 16), (16, 4, 128, 32), (12, 4, 64, 32)])
def test_cpu_paged_register_blocked_paths_equal_the_torch_backend(h, hkv, d, bs):
    """q . k sixteen token rows at a time (the rows after the last full sixteen of a block one by
    one) and P . V in registers, for head sizes 64 and 128, 3 and 4 query heads a KV head (128 takes
    them two at a time, then the rest), blocks of 16 and 32 rows; few requests (a KV head a work
    item) and many (a whole request)."""
    for lens in ([70, 33, 1], [90, 64, 48, 40, 33, 31, 17, 16, 15, 2]):
        meta = step_metadata(lens, None, random.Random(d + bs), bs)
        g = torch.Generator().manual_seed(h + len(lens))
        pool = torch.randn(BLOCKS, 1, 2, bs, hkv, d, generator=g)
        q = torch.randn(len(lens), h, d, generator=g)
        outs = [resolve_backend(name, torch.device("cpu"), bs).attend(q, None, None, pool[:, 0, 0], pool[:, 0, 1],
                                                                       meta, d**-0.5)
                for name in ("torch", "cpu_paged")]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_the_kernel_refuses_a_length_past_its_table():
    meta = step_metadata([20], None, random.Random(0))  # 2 blocks
    pool = torch.zeros(BLOCKS, 1, 2, BS, HKV, D)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pdserve_cpu.paged_decode(torch.zeros(1, H, D), pool[:, 0, 0], pool[:, 0, 1],
                                           meta.block_tables, torch.tensor([33], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 13, 16, 17, 23, 24, 25, 32, 40, 41, 47, 64])
@pytest.mark.parametrize("n, k", [(200, 96), (203, 100), (3, 7)])
def test_small_linear_equals_a_float64_reference_on_every_tile_path(rows, n, k):
    """Rows up to 4 take the dot path; 5-8 the dot tiles (4 rows x 4 weight rows on AVX-512, 2 x 4
    on AVX2); more go in blocks of two vectors' or one vector's worth of rows (zero-padded) through
    the broadcast kernel, 12 weight rows a tile, and the last <= 8 rows through the dot tiles. Tails
    of rows, of weight rows (n not a multiple of 12 or of 4) and of k (not a multiple of the vector
    width) each take their own code."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    want = F.linear(x.double(), w.double(), b.double())
    got = torch.ops.pdserve_cpu.small_linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.ops.pdserve_cpu.small_linear(x, w, None).double(), want - b.double(),
                               rtol=1e-5, atol=1e-4)
    # rows further apart than k (as place_weight lays them out), and a transposed view (copied first)
    padded = torch.full((n, k + 5), float("nan"))[:, :k].copy_(w)
    assert torch.equal(torch.ops.pdserve_cpu.small_linear(x, padded, b), got)
    wt = w.t().contiguous().t()
    torch.testing.assert_close(torch.ops.pdserve_cpu.small_linear(x, wt, b).double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 32])
def test_small_linear_sums_a_long_k_in_many_lanes(rows):
    """K = 8192 (a 1B model's down_proj): each path's RMS error against float64 is at most half that of
    one sequential float32 sum per output, computed here in a fixed order.

    Why half: a sum spread over L lanes of K / L products each has ~1/sqrt(L) the error of one
    sequential sum. The narrowest path (5-8 rows: dot tiles, one vector of VL lanes per output) has
    L = 8 with AVX2 (0.37 measured) and L = 16 with AVX-512 (0.26); the others measure 0.15-0.21 on
    either. A sequential or 2-lane sum (0.71) fails. The reference is not torch's own error: that is
    whatever BLAS path this CPU takes (at 8 rows 2.7e-7 on both ISAs, at 1 row 9.4e-7), and 2x it
    failed the AVX2 kernel at 5.8e-7 while it passed on AVX-512 at 4.1e-7.
    Check both ISAs on an AVX-512 machine: ATEN_CPU_CAPABILITY=avx2 builds and loads the AVX2 kernels."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 8192, generator=g), torch.randn(48, 8192, generator=g) / 8192**0.5
    want = F.linear(x.double(), w.double())

    def rms(y):
        return (y.double() - want).pow(2).mean().sqrt().item()

    products = x[:, None, :] * w[None, :, :]  # [rows, 48, K], each product rounded to float32 once
    sequential = products.numpy().cumsum(axis=-1, dtype="float32")[..., -1]  # numpy's cumsum: in order
    assert rms(torch.ops.pdserve_cpu.small_linear(x, w, None)) <= 0.5 * rms(torch.from_numpy(sequential))


@pytest.mark.parametrize("rows", [1, 2, 8, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_model_ops_equal_torch(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(SMALL_ROWS + 3, 96, generator=g)
    b = torch.randn(SMALL_ROWS + 3, generator=g) if bias else None
    norm_w = torch.randn(96, generator=g)
    fast, ref = CPUKernelOps(), TorchOps()
    torch.testing.assert_close(fast.linear(x, w, b), ref.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.rms_norm(x, norm_w, 1e-5), ref.rms_norm(x, norm_w, 1e-5), rtol=1e-6, atol=1e-6)
    res_fast, res_ref = w[:rows].clone(), w[:rows].clone()
    got, want = fast.add_rms_norm(x, res_fast, norm_w, 1e-5), ref.add_rms_norm(x, res_ref, norm_w, 1e-5)
    assert torch.equal(res_fast, res_ref) and torch.equal(res_ref, w[:rows] + x)  # the residual, in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(rows, 2 * 96, generator=g)
    torch.testing.assert_close(fast.silu_mul(gate_up), ref.silu_mul(gate_up), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("width", [1, 16, 37])
def test_silu_mul_equals_a_float64_reference_over_the_whole_range(width):
    """The vector exp behind SiLU, for gates far into both tails (where exp(-x) would overflow or
    underflow), zero, and widths that leave a partial vector."""
    g = torch.Generator().manual_seed(width)
    gate = torch.cat([torch.tensor([-200.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 200.0]),
                      torch.randn(4 * width, generator=g) * 10])
    gate = gate[: (gate.numel() // width) * width].view(-1, width)
    up = torch.randn(gate.shape, generator=g)
    got = CPUKernelOps().silu_mul(torch.cat([gate, up], dim=1))
    want = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)


def test_rope_in_place_equals_torch():
    from cluster.engine.model_config import RopeConfig  # noqa: PLC0415

    rot = RotaryEmbedding(32, 64, RopeConfig(theta=10000.0), torch.float32, torch.device("cpu"))
    cos, sin = rot(torch.tensor([0, 5, 17, 63]))
    qkv = torch.randn(4, (6 + 2 * 2) * 32, generator=torch.Generator().manual_seed(1))
    view = qkv[:, : 8 * 32].view(4, 8, 32)  # q and k heads: a strided view, as the model passes it
    want = TorchOps().rope(view.clone(), cos, sin)
    v_before = qkv[:, 8 * 32 :].clone()
    got = CPUKernelOps().rope(view, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 8 * 32 :], v_before)  # v untouched


def test_engines_on_the_kernels_and_on_torch_give_the_same_greedy_tokens(tiny_model):
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (1, 15, 16, 17, 40, 70, 130)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = {}
    for attention, ops in (("torch", "torch"), ("cpu_paged", "cpu_kernels")):
        engine = LLMEngine.from_model(tiny_model, num_blocks=96, max_num_batched_tokens=48,
                                      attention_backend=attention, model_ops=ops)
        assert engine.runner.backend.name == attention and engine.model.lm_head.ops.name == ops
        got[attention] = [o.token_ids for o in engine.generate(prompts, sp)]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert got["cpu_paged"] == got["torch"]


def test_weights_with_rows_a_multiple_of_512_floats_are_laid_out_apart_and_give_the_same_tokens(model_factory):
    """hidden 512: every linear but down_proj (K = 640) has K a multiple of WEIGHT_ALIGN, so the kernels'
    model reads those weights ROW_PAD floats apart; the tied embedding shares the LM head's."""
    model = model_factory("aligned", layers=2, hidden=512, heads=8, kv_heads=2, intermediate=640, vocab=320,
                          max_positions=512, seed=1, tie_embeddings=True)
    rng = random.Random(4)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (1, 17, 40, 130)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = {}
    for ops in ("torch", "cpu_kernels"):
        engine = LLMEngine.from_model(model, num_blocks=64, max_num_batched_tokens=48, model_ops=ops)
        m = engine.model
        strides = {name: w.stride() for name, w in (("lm_head", m.lm_head.weight),
                                                    ("down", m.layers[0].mlp.down_proj.weight),
                                                    ("qkv", m.layers[1].self_attn.qkv_proj.weight))}
        pad = ROW_PAD if ops == "cpu_kernels" else 0
        assert strides == {"lm_head": (512 + pad, 1), "down": (640, 1), "qkv": (512 + pad, 1)}
        assert m.embed_tokens.weight is m.lm_head.weight
        got[ops] = [o.token_ids for o in engine.generate(prompts, sp)]
    assert got["cpu_kernels"] == got["torch"]


def test_place_weight_pads_only_rows_a_multiple_of_512_floats_and_only_once():
    ops = CPUKernelOps()
    for k in (96, 1408):  # rows that already spread over L1's sets
        w = torch.randn(10, k)
        assert ops.place_weight(w) is w
    weight = torch.randn(10, 1024)
    placed = ops.place_weight(weight)
    assert placed.stride() == (1024 + ROW_PAD, 1) and torch.equal(placed, weight)
    padding = torch.as_strided(placed, (10, ROW_PAD), (1024 + ROW_PAD, 1), placed.storage_offset() + 1024)
    assert torch.equal(padding, torch.zeros(10, ROW_PAD))
    assert ops.place_weight(placed) is placed and TorchOps.place_weight(placed) is placed


def test_row_tables_make_every_row_of_a_short_chunk_a_decode_of_its_own():
    meta = step_metadata([40, 16], (32, 5), random.Random(0))  # two decodes, then 5 rows from position 32
    tables, lens = meta.row_tables
    assert lens.tolist() == [40, 16, 33, 34, 35, 36, 37] and lens.dtype == torch.int32
    assert torch.equal(tables, meta.block_tables[[0, 1, 2, 2, 2, 2, 2]])
    decode_only = step_metadata([40, 16], None, random.Random(0))
    assert decode_only.row_tables == (decode_only.block_tables, decode_only.seq_lens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("decode_lens, chunk", [
    ([1], None), ([17], None), ([40, 16], None), ([130, 64, 33, 2], None),
    ([40, 16], (32, 5)),  # a request verifying 4 drafts beside two decodes
    ([], (0, 9)),  # a whole short prompt
    ([7], (20, FUSED_MAX_CHUNK)),
])
def test_fused_decode_layers_equal_the_layer_by_layer_forward(model_factory, arch, decode_lens, chunk):
    """A step of at most FUSED_DECODE_ROWS rows whose chunks are at most FUSED_MAX_CHUNK long runs
    every layer in one kernel call (CPUKernelOps.decode_layers, each row attended as a decode): the
    same logits and the same KV written as the model's own layer loop on the kernels, and as plain
    torch ops over the torch attention backend."""
    model = LLMEngine.from_model(model_factory(f"fused-{arch}", layers=3, hidden=64, heads=4, kv_heads=2, arch=arch,
                                               seed=7), num_blocks=8).model
    cfg = model.cfg
    meta = step_metadata(decode_lens, chunk, random.Random(len(decode_lens)))
    rows = len(meta.slot_blocks)
    assert CPUKernelOps().fuses(meta) and not CPUKernelOps(fused_decode_rows=0).fuses(meta)
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(BLOCKS, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
    positions = torch.tensor([n - 1 for n in decode_lens] + (list(range(chunk[0], sum(chunk))) if chunk else []))
    logit_rows = torch.arange(rows)
    runs = []
    for ops, attention in ((CPUKernelOps(), "torch"), (CPUKernelOps(fused_decode_rows=0), "torch"),
                           (TorchOps(), "torch")):
        model.use_ops(ops)
        cache = pool.clone()
        logits = model(ids, positions, cache, meta, resolve_backend(attention, torch.device("cpu"), BS), logit_rows)
        runs.append((logits, cache))
    (fused, fused_cache), (layered, layered_cache), (ref, ref_cache) = runs
    # Rounding apart (attention: the paged kernel vs torch SDPA; torch's own linears), nothing else:
    # every layer's K/V written to the same slots, the rest of the pool untouched.
    untouched = (fused_cache == pool).all(dim=(1, 2, 4, 5))  # [blocks, block positions]
    assert torch.equal(untouched, (layered_cache == pool).all(dim=(1, 2, 4, 5)))
    assert int((~untouched).sum()) == rows  # one slot per new token
    torch.testing.assert_close(fused_cache, layered_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_cache, ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, layered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)


def test_only_small_decode_only_steps_take_the_fused_layers(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=96)
    engine.model.use_ops(CPUKernelOps(fused_decode_rows=4))
    calls = []
    fused = engine.model.ops.decode_layers
    engine.model.ops.decode_layers = lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k)
    prompts = [[5 + i] * (10 + i) for i in range(6)]
    # request i makes i + 1 tokens: after the prompts' step, decode steps of 5, 4, 3, 2 and 1 requests
    engine.generate(prompts, [SamplingParams(max_tokens=i + 1, temperature=0, ignore_eos=True) for i in range(6)])
    assert calls == [4, 3, 2, 1]  # 5 rows, and the prompts' step (75 rows), layer by layer
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
