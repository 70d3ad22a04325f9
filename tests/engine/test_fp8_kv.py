"""An fp8 KV pool (engine.kv_cache_dtype fp8, issue 49): twice the blocks of bf16 for the same memory;
attention over it equals the torch backend over its dequantized values; a cold one-chunk prefill
stores exactly quantize() of the K/V a bf16 pool stores (so its first token is bf16's); a
kv_cache_dtype the engine cannot run is refused, named."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from cluster.engine.attention.fp8_kv import FP8, FP8LayerBackend, check_fp8_device, dequantize, quantize
from cluster.engine.attention.metadata import AttentionMetadata, PrefillSpan
from cluster.engine.attention.torch_sdpa import TorchSDPABackend
from cluster.engine.config import EngineOptions
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts

BS, H, HKV, D, BLOCKS = 16, 4, 2, 32, 24


def step_meta(decode_lens: list[int], prefill: tuple[int, int]) -> AttentionMetadata:
    """Decodes (context lengths, longest first), then one chunk (start, length) over the cache;
    request i's blocks are 4i, 4i + 1, ..."""
    ctxs = decode_lens + [sum(prefill)]
    tables = [[4 * i + j for j in range(-(-c // BS))] for i, c in enumerate(ctxs)]
    slots = [(tables[i][p // BS], p % BS) for i, c in enumerate(decode_lens) for p in [c - 1]]
    slots += [(tables[-1][p // BS], p % BS) for p in range(prefill[0], sum(prefill))]
    mask = torch.arange(sum(prefill))[None, :] <= torch.arange(prefill[0], sum(prefill))[:, None]
    width = max(map(len, tables))
    q_lens = [1] * len(decode_lens) + [prefill[1]]
    return AttentionMetadata(
        slot_blocks=torch.tensor([b for b, _ in slots]), slot_offsets=torch.tensor([o for _, o in slots]),
        num_decode=len(decode_lens), prefills=(PrefillSpan(len(decode_lens), prefill[1], sum(prefill),
                                                           torch.tensor(tables[-1]), mask),),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_q_len=max(q_lens), max_seq_len=max(ctxs), block_size=BS, decode_seq_lens=tuple(decode_lens))


def test_fp8_attention_equals_torch_attention_over_the_dequantized_pool():
    torch.manual_seed(0)
    meta = step_meta([50, 33, 16, 1], (20, 12))
    t = len(meta.slot_blocks)
    ks, vs = 0.03, 0.011  # K values reach ~130 (saturating some), V values ~45
    cache8 = quantize(torch.randn(BLOCKS, 2, BS, HKV, D) * 30, 1 / 0.25)
    q, k, v = torch.randn(t, H, D), torch.randn(t, HKV, D) * 4, torch.randn(t, HKV, D)
    fp8 = FP8LayerBackend(ks, vs, torch.float32)
    fp8.write_kv(cache8[:, 0], cache8[:, 1], k, v, meta)
    assert cache8.dtype == FP8
    # the reference: a float pool holding the fp8 pool's values, after writing the same K/V rounded
    ref = torch.stack([dequantize(cache8[:, 0], ks, torch.float32), dequantize(cache8[:, 1], vs, torch.float32)], 1)
    kq = dequantize(quantize(k, fp8.k_inv), ks, torch.float32)
    vq = dequantize(quantize(v, fp8.v_inv), vs, torch.float32)
    assert torch.equal(ref[meta.slot_blocks, 0, meta.slot_offsets], kq)  # the written slots: quantize(k)
    assert torch.equal(ref[meta.slot_blocks, 1, meta.slot_offsets], vq)
    got = fp8.attend(q, k, v, cache8[:, 0], cache8[:, 1], meta, D**-0.5)
    want = TorchSDPABackend().attend(q, k, v, ref[:, 0], ref[:, 1], meta, D**-0.5)
    assert torch.equal(got, want)


def test_quantize_saturates_and_rounds_to_e4m3():
    x = torch.tensor([0.0, 1.0, -1.0625, 300.0, 1e4, -1e9, 2.0**-9])
    assert quantize(x, 1.0).float().tolist() == [0.0, 1.0, -1.0, 288.0, 448.0, -448.0, 2.0**-9]


@pytest.fixture(scope="module")
def bf16_model(model_factory) -> str:
    return model_factory("bf16kv", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512,
                         dtype="bfloat16", seed=1)


def test_fp8_pool_holds_twice_the_blocks_of_bf16_for_the_same_memory(bf16_model):
    bf16 = LLMEngine.from_model(bf16_model, kv_cache_memory_gb=0.01)
    fp8 = LLMEngine.from_model(bf16_model, kv_cache_memory_gb=0.01, kv_cache_dtype="fp8")
    # 2 layers x K,V x 16 tokens x 2 heads x 16 dims = 2048 values: 4096 bytes in bf16, 2048 in fp8
    assert (bf16.block_bytes, fp8.block_bytes) == (4096, 2048)
    assert (bf16.kv.num_blocks, fp8.kv.num_blocks) == (2621, 5242)
    assert (bf16.load().total_blocks, fp8.load().total_blocks) == (2621, 5242)  # what replicas report
    assert fp8.kv_cache.dtype == FP8 and fp8.kv_cache.shape[0] == 5242


def _held_blocks(engine: LLMEngine, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """(first token, the prompt's full blocks) after one cold prefill held for a peer."""
    engine.kv.pool.reset_cache()
    req = engine.make_request("held", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1, temperature=0))
    engine.add(req, hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    blocks = engine.block_ids("held")[: len(prompt) // engine.block_size]
    token = req.output_token_ids[0]
    data = engine.kv_cache[blocks].clone()
    engine.release("held")
    return token, data


def test_a_cold_prefill_stores_exactly_the_quantized_bf16_kv(bf16_model):
    bf16 = LLMEngine.from_model(bf16_model, num_blocks=32)
    fp8 = LLMEngine.from_model(bf16_model, num_blocks=32, kv_cache_dtype="fp8")
    prompt = prompts(1, [70], seed=7)[0]
    token16, kv16 = _held_blocks(bf16, prompt)
    token8, kv8 = _held_blocks(fp8, prompt)
    assert token8 == token16  # the chunk attends to its own fresh K/V
    inv = torch.tensor([[1 / k, 1 / v] for k, v in fp8.model.kv_quant.scales]).view(1, 2, 2, 1, 1, 1)
    inv = inv.float().apply_(lambda s: float(torch.tensor(s, dtype=torch.float32)))
    assert kv8.view(torch.uint8).equal(quantize(kv16, inv).view(torch.uint8))
    assert_leak_free(fp8)


def test_fp8_engine_serves_prefix_hits_from_the_pool_and_the_host_tier_alike(bf16_model):
    """Over an fp8 pool a cold chunk attends to its own fresh K/V and a prefix hit to the stored fp8
    values, so a hit may differ from the cold run; a hit from the host tier reads the same bytes a
    hit from the device pool reads, so those two are equal."""
    fp8 = LLMEngine.from_model(bf16_model, num_blocks=24, kv_cache_dtype="fp8", max_num_batched_tokens=64,
                               kv_tiers={"host_blocks": 32})
    long, *others = prompts(3, [200, 190, 180], seed=8)
    fp8.generate([long], GREEDY)  # cold, chunked: 13 blocks
    from_pool = fp8.generate([long], GREEDY)[0]
    fp8.generate(others, GREEDY)  # evicts the long prompt's blocks into the host tier
    host = fp8.kv.tiers[0]
    loaded = host.stats.loaded
    from_host = fp8.generate([long], GREEDY)[0]
    assert host.stats.loaded - loaded == 12  # its 12 full blocks, back from the host tier
    assert from_host.token_ids == from_pool.token_ids
    assert from_host.num_cached_tokens == from_pool.num_cached_tokens == 192
    assert_leak_free(fp8)


@pytest.mark.parametrize("options, message", [
    ({"attention_backend": "cpu_paged"}, "kv_cache_dtype=fp8: attention_backend=cpu_paged reads a float KV pool"),
    ({"static_decode": "eager"}, "kv_cache_dtype=fp8: static_decode=eager's paged kernel reads a float KV pool"),
    ({"tensor_parallel_size": 2}, "kv_cache_dtype=fp8 is not implemented with tensor_parallel_size > 1"),
])
def test_a_kv_cache_dtype_the_engine_cannot_run_is_refused(options, message):
    with pytest.raises(ValidationError) as e:
        EngineOptions(kv_cache_dtype="fp8", **options)
    assert message in str(e.value)
    with pytest.raises(ValidationError) as e:
        EngineOptions(kv_cache_dtype="int4")
    assert "kv_cache_dtype" in str(e.value) and "'auto', 'fp8' or 'fp8_e4m3'" in str(e.value)


def test_the_app_config_takes_kv_cache_dtype_per_pool(tiny_model):
    from cluster.config import AppConfig  # noqa: PLC0415

    cfg = AppConfig.model_validate({"model": tiny_model, "decode": {"engine": {"kv_cache_dtype": "fp8"}}})
    assert (cfg.engine_for("prefill").kv_cache_dtype, cfg.engine_for("decode").kv_cache_dtype) == ("auto", "fp8")
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({"model": tiny_model, "engine": {"kv_cache_dtype": "fp16"}})
    assert "engine.kv_cache_dtype\n  Input should be 'auto', 'fp8' or 'fp8_e4m3'" in str(e.value)


def test_a_device_that_cannot_hold_fp8_is_refused_by_name():
    check_fp8_device(torch.device("cpu"))
    with pytest.raises(ValueError) as e:
        check_fp8_device(torch.device("meta"))  # holds no values at all
    assert str(e.value).startswith("kv_cache_dtype=fp8: device meta cannot hold float8_e4m3fn KV")
