"""The saturation bench's arms against a real router process (cluster/tools/bench/saturation.py,
`--ray` and `--channel`): what one call costs the router's core over each transport.

One RouterActor (router/actor.py) over `replicas` replicas (P:D 1:3) and `blocks` blocks indexed,
as saturation_router.build_router leaves the in-process Router. This process is the load generator: it
keeps at most 64 calls in flight (many replicas' feeds, many ingress requests). Per arm: the
actor process's CPU (psutil, every thread: Ray's, and the channel's own thread and loop) per call,
and this process's cores.
  --ray      events (batch 8), report_load, feed (8 events + the load), route: Ray actor calls.
  --channel  route over the router's channel (router/channel.py: a socket, msgpack frames), as the
             ingress sends it since issue 50: a RouterRef's `route.remote` awaited on a uvloop loop;
             every call is checked to have gone over the channel (the router's `channel_calls`).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from cluster.tools.bench.saturation_router import build_router, prompts

IN_FLIGHT = 64
REFRESH_EVERY = 64  # route calls between re-reports of every load (saturation.bench_decisions's)
ROUTE_SECONDS = 2.0  # at most: the loads reported before a route arm go stale after 3 s


def _report_all(router, loads) -> int:
    for load in loads:
        router.report_load(load)
    return len(loads)


class RouterUnderTest:
    """The RouterActor the arms call, its process, and the calls' material."""

    def __init__(self, replicas: int, blocks: int, batch: int):
        import psutil
        import ray

        from router.actor import RouterActor

        rng = random.Random(0)
        local, systems = build_router(replicas, blocks, rng)
        self.actor = RouterActor.remote()
        self.proc = psutil.Process(ray.get(self.actor.__ray_call__.remote(lambda self: os.getpid())))
        for rid in local.index.replicas():
            ray.get(self.actor.resync.remote(rid, "inc", 0, list(local.index.hashes(rid))))
        self.loads = [load for _, load in local._loads.values()]
        self.report_loads()
        self.work = prompts(systems, 512, rng)
        self.fresh = iter(rng.randbytes(16) for _ in range(10_000_000))
        self.seqs = dict.fromkeys(local.index.replicas(), 0)
        self.ids = list(self.seqs)
        self.batch = batch

    def report_loads(self) -> None:
        import ray

        ray.get([self.actor.report_load.remote(load) for load in self.loads])

    def route_args(self, n: int) -> tuple:
        """The n-th route call's arguments (saturation.bench_decisions's: a session among 500).
        Every REFRESH_EVERY-th also re-reports the loads inside the actor (one Ray call), as the
        replicas' feeds do while serving, so the pending work a decision copies stays bounded."""
        if n % REFRESH_EVERY == 0:
            self.actor.__ray_call__.remote(_report_all, self.loads)
        hashes, tokens = self.work[n % len(self.work)]
        return hashes, tokens, f"s{n % 500}"

    def actor_cpu_s(self) -> float:
        return sum(self.proc.cpu_times()[:2])

    def next_batch(self, n: int) -> tuple[str, str, int, list]:
        """A replica's next event batch, as `events` and `feed` take it: (id, incarnation, seq, events)."""
        rid = self.ids[n % len(self.ids)]
        self.seqs[rid] += 1
        return rid, "inc", self.seqs[rid], [("+", next(self.fresh)) for _ in range(self.batch)]

    def result(self, name: str, n: int, actor_cpu: float, gen_cpu: float, wall: float) -> dict:
        return {"arm": name, "calls": n, "calls_per_s": n / wall, "actor_cores": actor_cpu / wall,
                "actor_cpu_us": actor_cpu / n * 1e6, "per_actor_core_s": n / actor_cpu,
                "loadgen_cores": gen_cpu / wall}


def ray_arm(r: RouterUnderTest, name: str, call, seconds: float) -> dict:
    """`call(n)` (an ObjectRef) for `seconds`, at most IN_FLIGHT unanswered."""
    import ray

    inflight, n = [], 0
    t_end = time.monotonic() + seconds
    a0, c0, w0 = r.actor_cpu_s(), time.process_time(), time.monotonic()
    while time.monotonic() < t_end:
        inflight.append(call(n))
        n += 1
        if len(inflight) >= IN_FLIGHT:
            ready, inflight = ray.wait(inflight, num_returns=IN_FLIGHT // 2)
            ray.get(ready)
    ray.get(inflight)
    return r.result(name, n, r.actor_cpu_s() - a0, time.process_time() - c0, time.monotonic() - w0)


async def _channel_routes(r: RouterUnderTest, seconds: float) -> tuple[int, float, float, float]:
    from router.actor import RouterRef

    ref = RouterRef("saturation-bench-router", lambda: r.actor)
    for _ in range(200):  # the connect runs in the background (bounded: 10 s)
        if ref.channel.usable():
            break
        await asyncio.sleep(0.05)
    if not ref.channel.usable():
        raise RuntimeError("the router's channel did not connect in 10 s")
    count = [0]
    t_end = time.monotonic() + seconds

    async def caller() -> None:
        while time.monotonic() < t_end:
            args = r.route_args(count[0])
            count[0] += 1
            await ref.route.remote(*args)

    a0, c0, w0 = r.actor_cpu_s(), time.process_time(), time.monotonic()
    await asyncio.gather(*(caller() for _ in range(IN_FLIGHT)))
    return count[0], r.actor_cpu_s() - a0, time.process_time() - c0, time.monotonic() - w0


def channel_arm(r: RouterUnderTest, seconds: float) -> dict:
    """`route` over the router's channel for `seconds`, IN_FLIGHT callers on one uvloop loop."""
    import ray
    import uvloop

    r.report_loads()
    before = ray.get(r.actor.channel_calls.remote())
    n, actor_cpu, gen_cpu, wall = uvloop.run(_channel_routes(r, seconds))
    by_channel = ray.get(r.actor.channel_calls.remote()) - before
    if by_channel != n:
        raise RuntimeError(f"{n - by_channel} of {n} route calls went by Ray, not the channel")
    return r.result("route (channel)", n, actor_cpu, gen_cpu, wall)


def bench_actor(replicas: int, blocks: int, seconds: float, batch: int, over_ray: bool, channel: bool) -> list[dict]:
    """The arms asked for against one RouterActor: the Ray calls, then route over the channel."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        r = RouterUnderTest(replicas, blocks, batch)
        a, out = r.actor, []
        route_s = min(seconds, ROUTE_SECONDS)
        if over_ray:
            out.append(ray_arm(r, f"events (batch {batch})", lambda n: a.events.remote(*r.next_batch(n)), seconds))
            out.append(ray_arm(r, "report_load", lambda n: a.report_load.remote(r.loads[n % len(r.loads)]), seconds))
            out.append(ray_arm(r, f"feed (batch {batch} + load)", lambda n: a.feed.remote(
                *r.next_batch(n), r.loads[n % len(r.loads)], None, time.time()), seconds))
            r.report_loads()
            out.append(ray_arm(r, "route (Ray)", lambda n: a.route.remote(*r.route_args(n)), route_s))
        if channel:
            out.append(channel_arm(r, route_s))
        return out
    finally:
        ray.shutdown()
