"""Pulls between pools of different KV dtypes over real NIXL (issue 49): a bf16 prefill pool feeding
an fp8 decode pool converts on the pull, to exactly the bytes an fp8 engine stores for the same
prompt (so decode's tokens are the fp8 engine's own), and the reverse dequantizes with the scales
the handshake's layout carries. A pull larger than the staging arena is refused and recomputed; two
that do not fit at once wait their turn. A pair of layouts no pull converts is refused, named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.engine.attention.fp8_kv import dequantize
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.local_peer import PrefillProcess
from decode.engine import DecodeEngine
from kv_transfer import convert
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.handle import KVLayout
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.transport import NixlTransport
from prefill.engine import PrefillEngine
from tests.engine.test_engine_correctness import prompts
from tests.helpers import wait_for
from tests.kv_transfer.test_kv_transfer import SP, assert_pools_whole, run_disaggregated

BF16 = {"dtype": "bfloat16"}
FP8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
PROMPTS = prompts(5, [1, 16, 17, 40, 70], seed=9)


@pytest.fixture(scope="module")
def model(model_factory) -> str:
    return model_factory("convert", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512, seed=2)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("convert-peers")


def make_decode(model, store, name, **kw) -> DecodeEngine:
    engine = LLMEngine.from_model(model, num_blocks=48, **kw)
    return DecodeEngine(engine, NixlTransport(name, engine.kv_cache, engine_layout(engine), FileMetadataStore(store)),
                        transfer_timeout_s=10.0)


@pytest.fixture(scope="module")
def bf16_prefill(model, store):
    proc = PrefillProcess(model, store, engine_id="prefill-bf16", num_blocks=48, **BF16)
    yield proc
    proc.close()


def test_bf16_prefill_to_fp8_decode_equals_an_fp8_engine(model, store, bf16_prefill):
    want = [o.token_ids for o in LLMEngine.from_model(model, num_blocks=64, **FP8).generate(PROMPTS, SP)]
    decode = make_decode(model, store, "decode-fp8", **FP8)
    try:
        got, finals = run_disaggregated(bf16_prefill, decode, PROMPTS, tag="to8")
        assert got == want
        st = decode.transport.stats
        blocks = sum(-(-len(p) // 16) for p in PROMPTS)  # every prompt block, the partial last ones too
        assert (st.pulls_ok, st.blocks_converted, st.blocks_pulled, st.fallbacks_recompute) == (5, blocks, blocks, 0)
        assert st.bytes_pulled == blocks * 4096  # the bf16 blocks crossed: 2 x 2 x 16 x 2 x 16 x 2 bytes
        assert_pools_whole(bf16_prefill, decode)
    finally:
        decode.transport.close()


def test_fp8_prefill_to_bf16_decode_dequantizes_with_the_peer_scales(model, store):
    # prefill in this process too (two NIXL agents side by side): its pool is at hand to compare with
    engine = LLMEngine.from_model(model, num_blocks=48, **FP8)
    prefill = PrefillEngine(engine, NixlTransport("prefill-fp8", engine.kv_cache, engine_layout(engine),
                                                  FileMetadataStore(store)))
    decode = make_decode(model, store, "decode-bf16", **BF16)
    prompt = PROMPTS[-1]  # 70 tokens: 4 full blocks and a partial one
    try:
        res = prefill.prefill("to16", prompt, SP)
        layout = res.handle.kv_layout
        assert layout.dtype == "float8_e4m3fn" and layout.kv_scales == engine_layout(engine).kv_scales
        assert len(layout.kv_scales) == 4  # K, V of 2 layers
        decode.submit("to16", prompt, SP, res.handle)
        def pulled() -> bool:
            prefill.service_leases()  # its agent progresses too (a prefill loop's every turn)
            decode.step()
            return decode.transport.stats.pulls_ok == 1

        wait_for(pulled, "the pull")
        mine = decode.engine.kv_cache[decode.engine.block_ids("to16")[:4]]
        theirs = engine.kv_cache[list(res.handle.block_ids[:4])]
        scales = torch.tensor(layout.kv_scales).view(1, 2, 2, 1, 1, 1)
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, dequantize(theirs, scales, torch.bfloat16))
        wait_for(lambda: decode.step() is not None and not decode.has_unfinished(), "decode")
        assert decode.transport.stats.blocks_converted == 5

        def both_whole() -> bool:
            decode.service()
            prefill.service_leases()
            return all(e.kv.num_free_blocks == e.kv.num_blocks for e in (engine, decode.engine))

        wait_for(both_whole, "both pools whole")
        assert prefill.transport.stats.leases_released == 1
    finally:
        decode.transport.close()
        prefill.transport.close()


def test_staging_too_small_recomputes_and_pulls_that_do_not_fit_together_wait(model, store, bf16_prefill,
                                                                             monkeypatch):
    monkeypatch.setattr(convert, "MIN_STAGING_SLOTS", 6)
    monkeypatch.setattr(convert, "STAGING_SHARE", 0.0)
    want = [o.token_ids for o in LLMEngine.from_model(model, num_blocks=64, **FP8).generate(PROMPTS, SP)]
    decode = make_decode(model, store, "decode-fp8-small", **FP8)
    try:
        # 40 and 70 tokens: 3 and 5 blocks, 8 together in 6 slots; 300 tokens: 19 blocks, more than 6
        big = prompts(1, [300], seed=10)[0]
        got, _ = run_disaggregated(bf16_prefill, decode, PROMPTS[3:] + [big], tag="small")
        assert got[:2] == want[3:]
        st = decode.transport.stats
        assert (st.pulls_ok, st.blocks_converted, st.fallbacks_recompute) == (2, 8, 1)
        assert_pools_whole(bf16_prefill, decode)
    finally:
        decode.transport.close()


LAYOUT = KVLayout("m.1", 16, "bfloat16", 2, 2, 16)
FP8_LAYOUT = dataclasses.replace(LAYOUT, dtype="float8_e4m3fn", kv_scales=(0.1, 0.2, 0.3, 0.4))


@pytest.mark.parametrize("ours, theirs, message", [
    (FP8_LAYOUT, dataclasses.replace(LAYOUT, tensor_parallel_size=2),
     "converting bfloat16 KV into float8_e4m3fn is implemented between tensor_parallel_size 1 pools only"),
    (LAYOUT, dataclasses.replace(LAYOUT, dtype="int8"),
     "dtype 'int8' != ours 'bfloat16', and 'int8' is not one a pull converts"),
    (LAYOUT, dataclasses.replace(FP8_LAYOUT, kv_scales=(1.0,)), "a float8_e4m3fn layout with 1 scales for 2 layers"),
])
def test_a_layout_pair_no_pull_converts_is_refused_at_handshake(ours, theirs, message):
    with pytest.raises(IncompatiblePeerError) as e:
        ours.check_compatible(theirs, "engine p")
    assert str(e.value).startswith("refusing KV from engine p: ") and message in str(e.value)
    assert FP8_LAYOUT.converts(LAYOUT) and not LAYOUT.converts(dataclasses.replace(LAYOUT))
