"""The router actor's index follows real engines' prefix caches exactly: through eviction, a lost
event batch, and a restart of the router itself; and a replica's feed never has more than one
call in flight: a router that does not answer gets one call, then one carrying everything since."""

import time

import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from router.actor import get_router
from tests.helpers import wait_until
from router.events import RouterFeed
from router.policy import PolicyConfig, ReplicaLoad


SP = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)




@pytest.fixture()
def router(ray_session):
    actor = get_router("tiny", app="test-router-feed").handle()  # this module's own router (and policy key)
    yield actor
    ray.kill(actor, no_restart=True)


def feed(router, rid: str, engine: LLMEngine, **kwargs) -> RouterFeed:
    load = lambda now: ReplicaLoad(rid, "prefill", engine.kv.num_free_blocks, engine.kv.num_blocks)  # noqa: E731
    return RouterFeed(rid, engine, router, load, **kwargs)


def in_sync(router, publisher: RouterFeed) -> bool:
    publisher.publish(time.monotonic())
    return ray.get(router.hashes.remote(publisher.replica_id)) == set(publisher.source.cached_block_hashes())


def test_index_tracks_engines_through_eviction_gaps_and_router_restarts(router, tiny_model):
    a = LLMEngine.from_model(tiny_model, num_blocks=12)  # small: later prompts evict earlier ones
    b = LLMEngine.from_model(tiny_model, num_blocks=64)
    pa = feed(router, "prefill-a", a, min_resync_interval_s=0)
    pb = feed(router, "prefill-b", b, min_resync_interval_s=0)
    system = [256] + list(range(1, 64))  # 4 full blocks

    a.generate([system + [100 + i] for i in range(3)], SP)
    b.generate([[256] + [7] * 40], SP)
    wait_until(lambda: in_sync(router, pa) and in_sync(router, pb), "index matches both pools")
    assert len(pa.source.cached_block_hashes()) >= 4

    for i in range(6):  # 12 blocks: forces evictions (removed events) on a
        a.generate([[256] + [(i * 37 + j) % 250 for j in range(47)]], SP)
    assert a.kv.pool.stats.evicted > 0
    wait_until(lambda: in_sync(router, pa), "index follows evictions")

    resyncs = pa.stats.snapshots
    pa.seq += 1  # a lost batch: the router sees a gap, refuses, and the publisher resyncs
    a.generate([[256] + [5] * 33], SP)
    wait_until(lambda: in_sync(router, pa) and pa.stats.snapshots == resyncs + 1, "resync after a gap")
    assert pa.stats.refused == 1

    ray.kill(router, no_restart=False)  # Ray restarts it, empty; every replica must resync
    wait_until(lambda: ray.get(router.stats.remote()).replicas == 0, "router restarted empty", timeout=30)
    a.generate([[256] + [6] * 20], SP)
    b.generate([[256] + [8] * 20], SP)
    wait_until(lambda: in_sync(router, pa) and in_sync(router, pb), "resync after a router restart", timeout=30)
    assert ray.get(router.stats.remote()).replicas == 2


def test_router_routes_to_the_replica_holding_the_prefix(router, tiny_model):
    engines = {rid: LLMEngine.from_model(tiny_model, num_blocks=64) for rid in ("prefill-x", "prefill-y")}
    pubs = {rid: feed(router, rid, e) for rid, e in engines.items()}
    system = [256] + list(range(1, 64))
    engines["prefill-y"].generate([system + [1]], SP)
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
    """A real Router whose feed answers no call until released (a router stuck behind a long
    call); it counts each replica's calls, and the most it ever held at once."""

    def __init__(self):
        import asyncio
        from collections import Counter

        from router.router import Router

        self.router, self.gate = Router(), asyncio.Event()
        self.calls, self.held, self.most_held = Counter(), Counter(), Counter()

    async def feed(self, replica_id, *args):
        self.calls[replica_id] += 1
        self.held[replica_id] += 1
        self.most_held[replica_id] = max(self.most_held[replica_id], self.held[replica_id])
        await self.gate.wait()
        self.held[replica_id] -= 1
        return self.router.feed(replica_id, *args)

    async def release(self):
        self.gate.set()

    async def counts(self) -> tuple[dict, dict]:
        return dict(self.calls), dict(self.most_held)

    async def hashes(self, replica_id):
        return self.router.hashes(replica_id)

    async def views(self):
        return self.router.feed_views()


def test_a_replicas_feed_never_has_more_than_one_call_in_flight(ray_session):
    """500 steps' events (one new block a step, 50 ms apart) to a router that answers nothing: each
    replica's feed sends one call (its first snapshot) and holds everything since, not 500 calls.
    Once the router answers, one more call brings the index to the pool's 500 blocks: a batch of
    all 500 events, or (past max_pending_events, replica b) a snapshot."""
    router = HeldRouter.remote()
    sources = {"a": GrowingSource(), "b": GrowingSource()}
    load = lambda rid: (lambda now: ReplicaLoad(rid, "prefill", 100, 1000))  # noqa: E731
    feeds = {"a": RouterFeed("a", sources["a"], router, load("a"), min_resync_interval_s=0),
             "b": RouterFeed("b", sources["b"], router, load("b"), min_resync_interval_s=0, max_pending_events=100)}
    now = 0.0
    for _ in range(500):
        now += 0.05
        for rid, f in feeds.items():
            sources[rid].step()
            f.publish(now, (rid, now))  # the queues change every step too
    assert [(f.in_flight, f.stats.calls, f.seq) for f in feeds.values()] == [(1, 1, 1)] * 2
    wait_until(lambda: ray.get(router.counts.remote())[0] == {"a": 1, "b": 1}, "the first calls reach the router")
    ray.get(router.release.remote())
    now += 0.05  # and no further: no heartbeat is due while the test waits

    def settled() -> bool:
        for f in feeds.values():
            f.publish(now, ("idle",), idle=True)
        return all(ray.get(router.hashes.remote(rid)) == set(sources[rid].stored) and f.in_flight == 0
                   for rid, f in feeds.items())

    wait_until(settled, "each index matches its pool after one more call")
    calls, most_held = ray.get(router.counts.remote())
    assert most_held == {"a": 1, "b": 1}
    a, b = feeds["a"].stats, feeds["b"].stats
    # a: step 1's event went in the first snapshot, steps 2-500's in one batch; b: past its 100
    # pending events every event went (1 + 101 + 398), and a second snapshot carried the pool
    assert (calls["a"], a.snapshots, a.max_events_per_call, a.dropped_events) == (2, 1, 499, 1)
    assert (calls["b"], b.snapshots, b.max_events_per_call, b.dropped_events) == (2, 2, 0, 500)
    views = {v.replica_id: v for v in ray.get(router.views.remote())}
    assert (views["a"].calls, views["b"].calls) == (2, 2)
    # lag, on the feed's clock: the first call carried step 1's change (t = 0.05 s), the second the
    # changes from step 2 on (t = 0.1 s); both answers were seen at `now`
    for f in (a, b):
        assert (f.lag_max_s, f.lag_last_s) == (pytest.approx(now - 0.05), pytest.approx(now - 0.1))
    ray.kill(router)


def test_a_feed_moved_to_another_cell_leaves_the_old_router_and_snapshots_to_the_new(ray_session):
    """A role flip across cells (router/cells.py): RouterFeed.move. The old cell's router forgets
    the replica after the call in flight (nothing re-adds it); the new one gets its whole pool in
    one snapshot, at once (not after min_resync_interval_s)."""
    old, new = (get_router("tiny", app="test-router-feed-move", cell=k) for k in (0, 1))
    source = GrowingSource()
    f = RouterFeed("r", source, old, lambda now: ReplicaLoad("r", "prefill", 100, 1000), min_resync_interval_s=60)
    now = 0.0
    try:
        for _ in range(3):
            source.step()
            now += 0.05
            f.publish(now, ("busy", now))
        wait_until(lambda: (f.publish(now, ("idle",), idle=True) or f.in_flight == 0)
                   and ray.get(old.hashes.remote("r")) == set(source.stored), "the old cell holds the pool")
        source.step()
        now += 0.05
        f.publish(now, ("busy", now))  # a call in flight to the old cell when the flip moves the feed
        assert f.move(get_router("tiny", app="test-router-feed-move", cell=1)) and not f.move(new)
        assert f.in_flight == 1 and f.moves == 1
        wait_until(lambda: (f.publish(now, ("idle",), idle=True) or f.in_flight == 0)
                   and ray.get(new.hashes.remote("r")) == set(source.stored), "the new cell holds the pool")
        assert ray.get(old.hashes.remote("r")) == set() and ray.get(old.feed_views.remote()) == []
        assert [v.replica_id for v in ray.get(new.feed_views.remote())] == ["r"]
        assert [x.replica_id for x in ray.get(new.live_loads.remote())] == ["r"]
        assert ray.get(old.live_loads.remote()) == []
        assert f.stats.snapshots == 2  # the first call's, and the new router's at once
    finally:
        for ref in (old, new):
            ray.kill(ref.handle(), no_restart=True)
