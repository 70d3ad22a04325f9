"""Latent attention over a real NIXL pull (issue 49): a DeepSeek-V3 prefill in another OS process, its
KV pulled by decode here. A block is the latent and the rope key per token and layer, so a pull moves
exactly those bytes; decode's tokens are transformers'. A latent and a GQA layout refuse each other
at the handshake, saying which is which."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.tools.local_peer import PrefillProcess
from decode.engine import DecodeEngine
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.handle import KVLayout
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.transport import NixlTransport
from tests.engine.test_engine_correctness import prompts
from tests.engine.test_families import write_checkpoint
from tests.kv_transfer.test_kv_transfer import SP, assert_pools_whole, run_disaggregated
from tests.reference import hf_greedy

LENGTHS = [1, 17, 40, 70]  # 1 + 2 + 3 + 5 blocks of 16
LATENT_BLOCK = 3 * 16 * (32 + 8) * 4  # layers x tokens x (kv_lora_rank + qk_rope_head_dim) x float32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("mla_pull"), "deepseek_v3")


@pytest.fixture(scope="module")
def decode(model, tmp_path_factory):
    store = tmp_path_factory.mktemp("mla_peers")
    prefill = PrefillProcess(model, store, engine_id="prefill-mla", num_blocks=32)
    engine = LLMEngine.from_model(model, num_blocks=32)
    transport = NixlTransport("decode-mla", engine.kv_cache, engine_layout(engine), FileMetadataStore(store))
    yield prefill, DecodeEngine(engine, transport, transfer_timeout_s=5.0)
    transport.close()
    prefill.close()


def test_a_pull_moves_the_latent_bytes_only_and_decodes_transformers_tokens(model, decode):
    prefill, dec = decode
    ps = prompts(len(LENGTHS), LENGTHS, seed=16)
    got, _ = run_disaggregated(prefill, dec, ps, tag="mla")
    assert got == [hf_greedy(model, p, SP.max_tokens) for p in ps]
    st = dec.transport.stats
    assert (st.pulls_ok, st.blocks_pulled, dec.transport.block_bytes) == (4, 11, LATENT_BLOCK)
    # 84,480 bytes: 11 blocks of latents; the expanded per-head K (24) and V (16) of 4 heads would be 4x that
    assert st.bytes_pulled == 11 * LATENT_BLOCK == 84_480
    assert_pools_whole(prefill, dec)


def test_a_latent_and_a_gqa_layout_refuse_each_other_by_name(decode):
    _, dec = decode
    mla = dec.layout
    assert (mla.latent_dim, mla.layout, mla.block_bytes) == (40, "block[L,1,bs,1,C+R]", LATENT_BLOCK)
    gqa = KVLayout(mla.model_fingerprint, 16, "float32", 3, 4, 24)
    with pytest.raises(IncompatiblePeerError) as e:
        mla.check_compatible(gqa, "engine p")
    assert str(e.value) == ("refusing KV from engine p: its blocks hold per-head K and V (4 KV heads x 24) and ours "
                            "the MLA latent (40 elements a token and layer): latent attention and GQA caches never mix")
    with pytest.raises(IncompatiblePeerError, match="its blocks hold the MLA latent .* and ours per-head K and V"):
        gqa.check_compatible(mla, "engine d")
    with pytest.raises(IncompatiblePeerError, match="refusing KV from engine p: latent_dim 48 != ours 40"):
        mla.check_compatible(dataclasses.replace(mla, latent_dim=48), "engine p")
