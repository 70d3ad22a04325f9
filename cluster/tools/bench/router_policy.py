"""Routing decision latency with a large index, in-process.

    python -m cluster.tools.bench.router_policy [--blocks 100000] [--requests 5000]

Builds a PrefixIndex over 8 prefill + 4 decode replicas tracking --blocks block hashes in all
(shared system prompts of 1024 tokens spread over the replicas, plus unrelated blocks), then
times RoutingPolicy.route for requests of a system prompt + 64-token suffix, from token ids: the
timed part hashes the prompt's blocks and decides (what the router does per request).
Prints p50/p99/max in microseconds against the 1 ms goal.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cluster.engine.kv_cache import hash_request_blocks
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

SALT = b"bench-model"


def build(blocks: int, rng: random.Random):
    prefills = [f"prefill-{i}" for i in range(8)]
    decodes = [f"decode-{i}" for i in range(4)]
    systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
    index = PrefixIndex()
    per_replica = blocks // (len(prefills) + len(decodes))
    for n, rid in enumerate(prefills + decodes):
        own = hash_request_blocks(systems[n % 8], 16, SALT) + hash_request_blocks(systems[(n + 3) % 8], 16, SALT)
        filler = [rng.randbytes(16) for _ in range(per_replica - len(own))]
        index.resync(rid, "inc", 0, own + filler)
    loads = [ReplicaLoad(r, "prefill", 4000, 8000, rng.randrange(8), rng.randrange(4), rng.randrange(4096),
                         0.02 + rng.random() * 0.01) for r in prefills]
    loads += [ReplicaLoad(r, "decode", 4000, 8000, rng.randrange(32), 0, 0, 0.03) for r in decodes]
    return index, loads, systems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=5000)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    index, loads, systems = build(args.blocks, rng)
    policy = RoutingPolicy(PolicyConfig(), random.Random(1))
    tracked = sum(index.num_blocks(r) for r in index.replicas())
    times = []
    for i in range(args.requests):
        prompt = systems[i % 8] + [rng.randrange(32000) for _ in range(64)]
        t = time.perf_counter()
        policy.route(hash_request_blocks(prompt, 16, SALT), len(prompt), index, loads)
        times.append(time.perf_counter() - t)
    times.sort()
    p = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e6  # noqa: E731
    print(f"{tracked} blocks tracked over {len(index.replicas())} replicas; {args.requests} decisions "
          f"(1088-token prompts, 68 block hashes each, hashing included)")
    print(f"decision latency: p50 {p(0.5):.0f} us, p99 {p(0.99):.0f} us, max {times[-1] * 1e6:.0f} us, "
          f"mean {statistics.mean(times) * 1e6:.0f} us (goal: p99 < 1000 us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
