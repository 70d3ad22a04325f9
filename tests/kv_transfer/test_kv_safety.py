"""KV safety over real NIXL between two OS processes: a READ still in flight never has its blocks
reused, a lease too close to its end is not pulled, released leases wait out a grace period.

The READ is held in flight from outside (as cluster/serving/faults.py does): the agent's
check_xfer_state reports a chosen READ "PROC" until the test lets it go. The READ itself was
really posted (over shared memory its copy already ran); what is tested is that nothing frees
or reuses its blocks before NIXL says it is over.
"""

import time
from dataclasses import replace

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.local_peer import PrefillProcess
from decode.engine import DecodeEngine
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.transport import NixlTransport
from tests.helpers import wait_for

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
VICTIM = [256] + [(5 * i + 1) % 250 for i in range(39)]  # 40 tokens: 3 blocks of 16
NEIGHBOUR = [256] + [(7 * i + 3) % 250 for i in range(69)]  # 70 tokens (+10 out): 5 blocks
GRACE_S = 0.5


class HeldReads:
    """The decode agent, with READs posted while `hold_next` is set reported in progress until
    `let_go()`: the transfer is genuinely posted, its completion is delayed."""

    def __init__(self, agent):
        self._agent = agent
        self.hold_next = False
        self.held: list = []
        self.release_refusals = 0

    def make_prepped_xfer(self, *args, **kwargs):
        handle = self._agent.make_prepped_xfer(*args, **kwargs)
        if self.hold_next:
            self.held.append(handle)
            self.hold_next = False
        return handle

    def check_xfer_state(self, handle) -> str:
        state = self._agent.check_xfer_state(handle)
        return "PROC" if any(h is handle for h in self.held) else state

    def release_xfer_handle(self, handle):
        if any(h is handle for h in self.held):  # NIXL cannot cancel an active transfer: it refuses
            self.release_refusals += 1
            raise RuntimeError("transfer in progress")
        return self._agent.release_xfer_handle(handle)

    def let_go(self):
        """The READ completes (or, past its deadline, NIXL manages to cancel it)."""
        self.held.clear()

    def __getattr__(self, name):
        return getattr(self._agent, name)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("peers-safety")


@pytest.fixture(scope="module")
def reference(tiny_model):
    eng = LLMEngine.from_model(tiny_model, num_blocks=64)
    return {tuple(p): o.token_ids for p, o in zip([VICTIM, NEIGHBOUR], eng.generate([VICTIM, NEIGHBOUR], SP))}


@pytest.fixture(scope="module")
def prefill(tiny_model, store):
    proc = PrefillProcess(tiny_model, store, engine_id="prefill-safety", num_blocks=16, release_grace_s=GRACE_S)
    yield proc
    proc.close()


@pytest.fixture()
def decode(tiny_model, store, request):
    engine = LLMEngine.from_model(tiny_model, num_blocks=8)
    transport = NixlTransport(f"decode-{request.node.name}", engine.kv_cache, engine_layout(engine),
                              FileMetadataStore(store))
    transport.agent = HeldReads(transport.agent)
    d = DecodeEngine(engine, transport, transfer_timeout_s=getattr(request, "param", 30.0), min_lease_left_s=5.0)
    yield d
    transport.agent.let_go()
    transport.close()


def counts(decode) -> tuple[int, int, int]:
    """(free, used, quarantined) of the decode pool, invariants checked."""
    decode.engine.check_invariants()
    load = decode.engine.load()
    return load.free_blocks, load.total_blocks - load.free_blocks - load.quarantined_blocks, load.quarantined_blocks


def turn(decode) -> list:
    decode.service()
    return decode.step()


def test_an_aborted_in_flight_read_keeps_its_blocks_until_it_settles(prefill, decode, reference):
    agent = decode.transport.agent
    # 1a. the victim's READ is posted and stays in flight
    victim = prefill.prefill("victim", VICTIM, SP)
    agent.hold_next = True
    decode.submit("victim", VICTIM, SP, victim.handle)
    for _ in range(3):
        assert turn(decode) == []
    assert len(agent.held) == 1
    targets = decode.engine.block_ids("victim")
    assert targets == [0, 1, 2] and counts(decode) == (5, 3, 0)

    # 1b. the client goes away: the request ends, its blocks do not come back
    decode.abort("victim")
    assert counts(decode) == (5, 0, 3)
    assert decode.engine.kv.pool.quarantined_block_ids() == targets
    assert decode.transport.stats.pulls_abandoned == 1

    # 2. a neighbour needs exactly the 5 free blocks: it gets them, never the quarantined ones
    neighbour = prefill.prefill("neighbour", NEIGHBOUR, SP)
    decode.submit("neighbour", NEIGHBOUR, SP, neighbour.handle)
    assert not set(decode.engine.block_ids("neighbour")) & set(targets)
    assert counts(decode) == (0, 5, 3)
    tokens, deadline = [neighbour.handle.first_token], time.monotonic() + 60
    while decode.has_unfinished():
        assert time.monotonic() < deadline, "neighbour did not finish"
        for out in turn(decode):
            assert out.request_id == "neighbour"
            tokens += out.token_ids
        assert decode.engine.kv.pool.quarantined_block_ids() == targets  # all the while
    assert tokens == reference[tuple(NEIGHBOUR)]
    assert counts(decode) == (5, 0, 3)  # the READ is still in flight: its blocks still held

    # 3. the READ completes: the next turn gives its blocks back
    agent.let_go()
    turn(decode)
    assert counts(decode) == (8, 0, 0)
    st = decode.transport.stats
    assert (st.pulls_abandoned, st.abandoned_settled, st.pulls_ok) == (1, 1, 1)
    assert decode.transport.num_abandoned == 0

    # 4. prefill: the neighbour's lease ended with its READ ("done", at once); the victim's was
    # released by a decode whose READ might still be reading: its blocks waited out the grace
    wait_for(lambda: (turn(decode), (s := prefill.stats())["leases"] == 0 and s["in_grace"] == 0
                      and s["free"] == s["total"])[1], what="prefill blocks back after the grace")
    assert prefill.stats()["grace_blocks_released"] >= 3


@pytest.mark.parametrize("decode", [1.0], indirect=True)  # transfer timeout 1 s
def test_a_read_that_never_settles_is_held_until_nixl_cancels_it(prefill, decode, reference):
    agent = decode.transport.agent
    victim = prefill.prefill("stuck", VICTIM, SP)
    agent.hold_next = True
    decode.submit("stuck", VICTIM, SP, victim.handle)
    decode.abort("stuck")
    assert counts(decode) == (5, 0, 3)
    # past the READ's deadline NIXL still refuses to cancel it: the quarantine stands
    wait_for(lambda: (turn(decode), agent.release_refusals >= 2)[1], what="release refused past the deadline")
    assert counts(decode) == (5, 0, 3)
    # NIXL cancels it: the blocks come back on the next turn
    agent.let_go()
    turn(decode)
    assert counts(decode) == (8, 0, 0)
    assert decode.transport.stats.abandoned_settled == 1


def test_a_handle_with_too_little_lease_left_is_recomputed(prefill, decode, reference):
    res = prefill.prefill("late", VICTIM, SP)
    late = replace(res.handle, lease_expiry=time.time() + 1.0)  # 1 s left < min_lease_left_s (5 s)
    decode.submit("late", VICTIM, SP, late)
    assert decode.engine.load().importing == 0  # not pulled
    tokens, deadline = [late.first_token], time.monotonic() + 60
    while decode.has_unfinished():
        assert time.monotonic() < deadline
        for out in turn(decode):
            tokens += out.token_ids
    assert tokens == reference[tuple(VICTIM)]
    st = decode.transport.stats
    assert (st.pulls_refused_lease, st.fallbacks_recompute, st.pulls_ok) == (1, 1, 0)
    assert counts(decode) == (8, 0, 0)
    # no READ was posted: prefill frees at once ("done"), no grace. The decode keeps turning as its
    # loop does when idle: its service() progresses UCX, which is what sends the notification out
    # (with nothing else to progress it, it can sit in the worker: 1 run in ~7 timed out here)
    wait_for(lambda: (turn(decode), (s := prefill.stats())["leases"] == 0 and s["free"] == s["total"])[1],
             what="lease released")
