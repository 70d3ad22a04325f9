"""The router actor's index follows real engines' prefix caches exactly: through eviction, a lost
event batch, and a restart of the router itself."""


import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from router.actor import get_router
from tests.helpers import wait_until
from router.events import KVEventPublisher
from router.policy import PolicyConfig, ReplicaLoad


SP = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)




@pytest.fixture()
def router(ray_session):
    actor = get_router("tiny", app="test-router-feed").handle()  # this module's own router (and policy key)
    yield actor
    ray.kill(actor, no_restart=True)


def in_sync(router, publisher: KVEventPublisher) -> bool:
    publisher.publish()
    return ray.get(router.hashes.remote(publisher.replica_id)) == set(publisher.source.cached_block_hashes())


def test_index_tracks_engines_through_eviction_gaps_and_router_restarts(router, tiny_model):
    a = LLMEngine.from_model(tiny_model, num_blocks=12)  # small: later prompts evict earlier ones
    b = LLMEngine.from_model(tiny_model, num_blocks=64)
    pa = KVEventPublisher("prefill-a", a, router, min_resync_interval_s=0)
    pb = KVEventPublisher("prefill-b", b, router, min_resync_interval_s=0)
    system = [256] + list(range(1, 64))  # 4 full blocks

    a.generate([system + [100 + i] for i in range(3)], SP)
    b.generate([[256] + [7] * 40], SP)
    wait_until(lambda: in_sync(router, pa) and in_sync(router, pb), "index matches both pools")
    assert len(pa.source.cached_block_hashes()) >= 4

    for i in range(6):  # 12 blocks: forces evictions (removed events) on a
        a.generate([[256] + [(i * 37 + j) % 250 for j in range(47)]], SP)
    assert a.kv.pool.stats.evicted > 0
    wait_until(lambda: in_sync(router, pa), "index follows evictions")

    resyncs = pa.resyncs
    pa.seq += 1  # a lost batch: the router sees a gap, refuses, and the publisher resyncs
    a.generate([[256] + [5] * 33], SP)
    wait_until(lambda: in_sync(router, pa) and pa.resyncs == resyncs + 1, "resync after a gap")

    ray.kill(router, no_restart=False)  # Ray restarts it, empty; every replica must resync
    wait_until(lambda: ray.get(router.stats.remote()).replicas == 0, "router restarted empty", timeout=30)
    a.generate([[256] + [6] * 20], SP)
    b.generate([[256] + [8] * 20], SP)
    wait_until(lambda: in_sync(router, pa) and in_sync(router, pb), "resync after a router restart", timeout=30)
    assert ray.get(router.stats.remote()).replicas == 2


def test_router_routes_to_the_replica_holding_the_prefix(router, tiny_model):
    engines = {rid: LLMEngine.from_model(tiny_model, num_blocks=64) for rid in ("prefill-x", "prefill-y")}
    pubs = {rid: KVEventPublisher(rid, e, router) for rid, e in engines.items()}
    system = [256] + list(range(1, 64))
    engines["prefill-y"].generate([system + [1]], SP)
    for rid, e in engines.items():
        ray.get(router.report_load.remote(ReplicaLoad(rid, "prefill", e.kv.num_free_blocks, e.kv.num_blocks)))
    ray.get(router.report_load.remote(ReplicaLoad("decode-0", "decode", 64, 64)))
    wait_until(lambda: all(in_sync(router, p) for p in pubs.values()), "index in sync")
    prompt = system + [9] * 30  # 94 tokens, 4 of its 5 full blocks cached on prefill-y
    engine = engines["prefill-y"]
    req = engine.make_request("probe", None, prompt, SP)
    hashes = engine.kv.update_hashes(req)
    d = ray.get(router.route.remote(hashes, len(prompt)))
    assert (d.prefill, d.decode, d.mode, d.predicted_cached_tokens) == ("prefill-y", "decode-0", "remote", 64)
    assert d.reason == "cache"
    ray.get(router.forget.remote("prefill-y"))  # a dead replica: never named again
    d = ray.get(router.route.remote(hashes, len(prompt)))
    assert (d.prefill, d.predicted_cached_tokens) == ("prefill-x", 0)


def actor_pid(actor) -> int:
    import os

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def test_restarted_router_keeps_its_configured_policy(router):
    """Ray re-runs __init__ on a restart: the policy configure() set must come back, exactly."""
    configured = PolicyConfig(block_size=32, local_prefill_threshold=7, hot_load_cap=5, slow_factor=3.5)
    ray.get(router.configure.remote(configured, "round_robin"))
    assert ray.get(router.policy_settings.remote()) == (configured, "round_robin")
    before = actor_pid(router)
    try:
        ray.kill(router, no_restart=False)
        wait_until(lambda: actor_pid(router) != before, "the router restarts in a new process", timeout=30)
        assert ray.get(router.policy_settings.remote()) == (configured, "round_robin")
    finally:  # the cluster's default policy again for the next test module's router
        ray.get(router.configure.remote(PolicyConfig(), "cost"))


class GrowingSource:
    """A pool that stores one new block each step (the BlockEventSource the publisher reads)."""

    def __init__(self):
        self.stored: list[bytes] = []
        self._events: list = []

    def step(self) -> None:
        self.stored.append(len(self.stored).to_bytes(16, "big"))
        self._events.append(("+", self.stored[-1]))

    def drain_block_events(self) -> list:
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.stored)

    def tier_block_hashes(self) -> list:
        return []


@ray.remote
class HeldRouter:
    """A real Router that answers no call until released (a router stuck behind a long call);
    it counts the calls that reached it."""

    def __init__(self):
        import asyncio

        from router.router import Router

        self.router, self.gate, self.calls = Router(), asyncio.Event(), 0

    async def events(self, *args):
        self.calls += 1
        await self.gate.wait()
        return self.router.events(*args)

    async def resync(self, *args):
        self.calls += 1
        await self.gate.wait()
        return self.router.resync(*args)

    async def release(self):
        self.gate.set()

    async def received(self) -> int:
        return self.calls

    async def hashes(self, replica_id):
        return self.router.hashes(replica_id)


def test_a_router_that_does_not_answer_holds_at_most_max_unacked_calls(ray_session):
    """500 steps' events to a router that answers nothing: the publisher waits on exactly
    max_unacked calls (the first snapshot and 7 batches), not 500, and the router's mailbox holds
    no more; once the router answers, a snapshot brings its index to the pool's 500 blocks."""
    router, source = HeldRouter.remote(), GrowingSource()
    pub = KVEventPublisher("replica", source, router, min_resync_interval_s=0, max_unacked=8)
    for _ in range(500):
        source.step()
        pub.publish()
    assert (pub.unacknowledged, pub.seq) == (8, 8)
    wait_until(lambda: ray.get(router.received.remote()) == 8, "the 8 calls reach the router")
    ray.get(router.release.remote())
    wait_until(lambda: (pub.publish(), ray.get(router.hashes.remote("replica")))[1] == set(source.stored)
               and pub.unacknowledged == 0, "the router's index matches the pool after a snapshot")
    assert (pub.resyncs, pub.unacknowledged, len(source.stored)) == (2, 0, 500)
    assert ray.get(router.received.remote()) == 9  # the 8 held calls, then the one snapshot
    ray.kill(router)
