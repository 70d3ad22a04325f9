"""KV transfer between tensor-parallel degrees over real NIXL (UCX over shared memory / TCP).

The tp=2 side runs in this process as rank 0 with its worker spawned (launch.py); the tp=1 side
is a child process (P tp=1 -> D tp=2) or a second engine in this process (P tp=2 -> D tp=1, the
prefill's loop turned by the test between decode steps). Each case checks: greedy tokens equal
the single engine's, each decode rank pulled exactly its heads' bytes of the pulled blocks (as its
own process counted them), and every rank's pool is whole afterwards with the same block count.
"""

from __future__ import annotations

import time

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.launch import tensor_parallel_engine
from kv_transfer.rank_reads import RankKV
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.local_peer import PrefillProcess
from decode.engine import DecodeEngine
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.transport import NixlTransport
from prefill.engine import PrefillEngine
from tests.helpers import wait_for
from tests.kv_transfer.test_kv_transfer import assert_pools_whole, run_disaggregated

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[256] + [(7 * i + 3 * n) % 250 for i in range(n - 1)] for n in (9, 17, 40)]  # 1, 2, 3 blocks
BLOCKS = 48
SHAPES = {"gqa-2kv": dict(heads=4, kv_heads=2), "mqa-1kv-replicated": dict(heads=4, kv_heads=1)}
# DeepSeek-V3 (tests/engine/test_families.py's, 2 layers): every rank holds the whole latent, so each
# decode rank reads every pulled block whole, from one prefill rank.
LATENT = "mla-latent-whole"


@pytest.fixture(scope="module", params=[*SHAPES, LATENT])
def model(request, model_factory, tmp_path_factory):
    if request.param == LATENT:
        from tests.engine.test_families import write_checkpoint  # noqa: PLC0415

        return write_checkpoint(tmp_path_factory.mktemp("tpkv-mla"), "deepseek_v3", seed=5, num_hidden_layers=2)
    return model_factory(f"tpkv-{request.param}", layers=2, hidden=64, vocab=320, max_positions=512, seed=5,
                         **SHAPES[request.param])


def reference(model: str) -> list[list[int]]:
    engine = LLMEngine.from_model(model, num_blocks=BLOCKS)
    return [o.token_ids for o in engine.generate(PROMPTS, SP)]


def tp2_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, tensor_parallel_size=2, num_blocks=BLOCKS)


def assert_ranks_whole(engine: LLMEngine) -> None:
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks == BLOCKS
    assert [r.kv_shape[0] for r in engine.tensor_parallel.reports()] == [BLOCKS, BLOCKS]


@pytest.mark.timeout(120)
def test_prefill_tp1_to_decode_tp2(model, tmp_path):
    expected = reference(model)
    prefill = PrefillProcess(model, tmp_path, engine_id="prefill-tp1", num_blocks=BLOCKS)
    try:
        with tensor_parallel_engine(tp2_config(model), extension=RankKV()) as (engine, ranks):
            transport = NixlTransport("decode-tp2", engine.kv_cache, engine_layout(engine),
                                      FileMetadataStore(tmp_path), tensor_parallel=engine.tensor_parallel)
            decode = DecodeEngine(engine, transport)
            try:
                got, _ = run_disaggregated(prefill, decode, PROMPTS, sp=SP)
                assert got == expected
                st = transport.stats
                assert (st.pulls_ok, st.fallbacks_recompute, st.blocks_pulled) == (3, 0, 6)
                # each rank's pool holds half the heads (GQA), the one head (replicated) or the latent
                # (whole): its block is its share, and it read exactly that many bytes per pulled block
                assert transport.mapped.bytes_by_rank == [6 * transport.block_bytes] * 2
                assert_pools_whole(prefill, decode)
                assert_ranks_whole(engine)
            finally:
                transport.close()
        assert ranks.exit_codes == [0]
    finally:
        prefill.close()


@pytest.mark.timeout(120)
def test_prefill_tp2_to_decode_tp1(model, tmp_path):
    expected = reference(model)
    store = FileMetadataStore(tmp_path)
    dec_engine = LLMEngine.from_model(model, num_blocks=BLOCKS)
    dec_transport = NixlTransport("decode-tp1", dec_engine.kv_cache, engine_layout(dec_engine), store)
    decode = DecodeEngine(dec_engine, dec_transport)
    try:
        with tensor_parallel_engine(tp2_config(model), extension=RankKV()) as (engine, ranks):
            transport = NixlTransport("prefill-tp2", engine.kv_cache, engine_layout(engine), store,
                                      tensor_parallel=engine.tensor_parallel)
            prefill = PrefillEngine(engine, transport, release_grace_s=0.2)
            try:
                tokens = {}
                for i, p in enumerate(PROMPTS):
                    res = prefill.prefill(f"r{i}", p, SP)
                    tokens[f"r{i}"] = [res.handle.first_token]
                    decode.submit(f"r{i}", p, SP, res.handle)
                deadline = time.monotonic() + 60
                while decode.has_unfinished():
                    assert time.monotonic() < deadline, "decode did not finish"
                    for out in decode.step():
                        tokens[out.request_id] += out.token_ids
                    prefill.service()  # rank 0's agent progresses on the prefill's loop (rank 1: a thread)
                assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
                st = dec_transport.stats
                assert (st.pulls_ok, st.fallbacks_recompute, st.blocks_pulled) == (3, 0, 6)
                assert dec_transport.mapped.bytes_by_rank == [6 * dec_transport.block_bytes]

                def leases_over() -> bool:
                    decode.service()
                    prefill.service()
                    return prefill.num_leases == 0

                wait_for(leases_over, what="prefill leases ended by the done notices", timeout=15)
                assert transport.stats.leases_released == 3 and transport.stats.leases_expired == 0
                assert_ranks_whole(engine)
                dec_engine.check_invariants()
                assert dec_engine.kv.num_free_blocks == BLOCKS
            finally:
                transport.close()
        assert ranks.exit_codes == [0]
    finally:
        dec_transport.close()
