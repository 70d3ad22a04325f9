"""What a pull between tensor-parallel degrees costs the decode group (issue 52): the collectives the
driver issues and the bytes it broadcasts, counted by a shim around torch.distributed's object
collectives in this process (rank 0), over real NIXL and gloo.

Each rank plans its own READs from the pull's small inputs (block ids, the peer's published ranks),
so the message that starts a pull does not grow with the descriptors; the driver polls its own part
locally and asks the workers once, when its part is done, so a pull costs the same collectives
however many times the engine polls it. A worker whose part lags is asked again on a backoff
schedule, not on every poll.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch.distributed as dist

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.launch import tensor_parallel_engine
from cluster.engine.distributed.step import KVPoll, KVRegister
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.local_peer import PrefillProcess
from decode.engine import DecodeEngine
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.rank_reads import RankKV
from kv_transfer.transport import NixlTransport
from tests.kv_transfer.test_kv_transfer import assert_pools_whole, run_disaggregated
from tests.kv_transfer.test_kv_transfer_tp import BLOCKS, PROMPTS, SP

HELD_POLLS = 20  # polls of each pull that see rank 0's part still running (it is done: held from outside)
LAG = 2  # settle answers of each pull in which the worker says its part still runs (it may be done)


class CollectiveCount:
    """torch.distributed's object broadcast and gather in this process, counted by the message they
    carry (a gather is counted under the broadcast before it) with the pickled bytes broadcast."""

    def __init__(self, monkeypatch):
        self.calls: Counter = Counter()
        self.read_bytes: list[int] = []  # each KVRead broadcast's pickled size
        self._last = ""
        broadcast, gather = dist.broadcast_object_list, dist.gather_object

        def counted_broadcast(objects, src=0, **kw):
            self._last = type(objects[0]).__name__
            self.calls["broadcast " + self._last] += 1
            if self._last == "KVRead":
                self.read_bytes.append(len(pickle.dumps(objects)))
            return broadcast(objects, src=src, **kw)

        def counted_gather(obj, out=None, dst=0, **kw):
            self.calls["gather " + self._last] += 1
            return gather(obj, out, dst=dst, **kw)

        monkeypatch.setattr(dist, "broadcast_object_list", counted_broadcast)
        monkeypatch.setattr(dist, "gather_object", counted_gather)

    def kv(self) -> dict[str, int]:
        return {k: v for k, v in self.calls.items() if " KV" in k and "KVRegister" not in k}


class LaggingRankKV(RankKV):
    """A worker rank whose first LAG answers to each pull's settle say its part still runs (a rank
    slower than rank 0), wrapped around the real agent from outside."""

    def handle(self, msg, rank: int, shard) -> None:
        super().handle(msg, rank, shard)
        if isinstance(msg, KVRegister):
            settle, asked = self.agent.settle, Counter()

            def lagging(pull_id: int, wait_s: float) -> str:
                asked[pull_id] += 1
                return "PROC" if asked[pull_id] <= LAG else settle(pull_id, wait_s)

            self.agent.settle = lagging


def hold_rank0(transport: NixlTransport, polls: int) -> list[int]:
    """Rank 0's part reads PROC for its first `polls` looks at each pull's handles; returns the
    count of looks, whatever they saw."""
    poster, looks = transport.mapped.poster, Counter()
    state = poster.state

    def held(handles: list) -> str:  # a pull's list of rank 0's handles, the same list until done
        looks[id(handles)] += 1
        return "PROC" if looks[id(handles)] <= polls else state(handles)

    poster.state = held
    return looks


@pytest.fixture(scope="module")
def gqa_model(model_factory):
    return model_factory("tpkv-count", layers=2, hidden=64, vocab=320, max_positions=512, seed=5, heads=4,
                         kv_heads=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker", ["prompt", "lagging"])
def test_a_pull_costs_the_same_collectives_however_often_it_is_polled(gqa_model, tmp_path, monkeypatch, worker):
    expected = [o.token_ids for o in LLMEngine.from_model(gqa_model, num_blocks=BLOCKS).generate(PROMPTS, SP)]
    prefill = PrefillProcess(gqa_model, tmp_path, engine_id="prefill-tp1", num_blocks=BLOCKS)
    config = EngineConfig(model=gqa_model, tensor_parallel_size=2, num_blocks=BLOCKS)
    lag = LAG if worker == "lagging" else 0
    try:
        with tensor_parallel_engine(config, extension=LaggingRankKV() if lag else RankKV()) as (engine, ranks):
            transport = NixlTransport("decode-tp2", engine.kv_cache, engine_layout(engine),
                                      FileMetadataStore(tmp_path), tensor_parallel=engine.tensor_parallel)
            looks = hold_rank0(transport, HELD_POLLS)
            count = CollectiveCount(monkeypatch)
            try:
                decode = DecodeEngine(engine, transport)
                got, _ = run_disaggregated(prefill, decode, PROMPTS, sp=SP)
                monkeypatch.undo()
                assert got == expected
                assert transport.stats.pulls_ok == 3
                assert transport.mapped.bytes_by_rank == [6 * transport.block_bytes] * 2
                assert len(looks) == 3 and min(looks.values()) > HELD_POLLS  # each pull polled past the held looks
                # per pull: one broadcast starts it, one broadcast + gather asks the worker (again
                # after each lagging answer), nothing releases it (every rank let go when done)
                asks = 3 * (1 + lag)
                assert count.kv() == {"broadcast KVRead": 3, "broadcast KVPoll": asks, "gather KVPoll": asks}
                # the start carries block ids and the peer's ranks, not descriptors: the 3-block
                # pull's message is the 1-block pull's plus two block ids a side
                one, three = min(count.read_bytes), max(count.read_bytes)
                assert 0 < three - one <= 4 * 9 and three < 4096
                assert_pools_whole(prefill, decode)
            finally:
                transport.close()
        assert ranks.exit_codes == [0]
    finally:
        prefill.close()
