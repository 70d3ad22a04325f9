"""What a control actor's ActorRef (router/actor.py) costs a call against the bare Ray handle: the
ref looks its handle up and registers a completion callback that watches for ActorDiedError, on
one call per WATCH_INTERVAL_S (arm `ActorRef`) or, for comparison, on every call (arm
`watch-all`). One router actor, awaited calls of a cheap method (`pending_requests`) one at a time
from an event loop, as the ingress makes its `route` calls; the arms rotate over rounds.

    python -m cluster.tools.bench.actor_ref [--calls 2000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


async def _arm(target, calls: int, watch_s: float) -> float:
    """Microseconds per awaited call."""
    import router.actor

    router.actor.WATCH_INTERVAL_S = watch_s
    t0 = time.perf_counter()
    for _ in range(calls):
        await target.pending_requests.remote()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    import ray

    from router.actor import WATCH_INTERVAL_S, get_router, kill_app_actors

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="per arm per round")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    app = "bench-actor-ref"
    try:
        ref = get_router("m", app)
        handle = ref.handle()
        arms = {"handle": (handle, WATCH_INTERVAL_S), "ActorRef": (ref, WATCH_INTERVAL_S), "watch-all": (ref, 0.0)}
        times: dict[str, list[float]] = {name: [] for name in arms}

        async def run():
            for target, watch_s in arms.values():  # warm-up
                await _arm(target, 200, watch_s)
            names = list(arms)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    target, watch_s = arms[name]
                    times[name].append(await _arm(target, args.calls, watch_s))

        asyncio.run(run())
        med = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            print(f"{name:>9}: median {med[name]:7.1f} us/call  (rounds: {', '.join(f'{x:.1f}' for x in t)})")
        for name in ("ActorRef", "watch-all"):
            print(f"{name} / handle: {med[name] / med['handle']:.3f}x ({med[name] - med['handle']:+.1f} us/call)")
    finally:
        kill_app_actors(app)
        ray.shutdown()


if __name__ == "__main__":
    main()
