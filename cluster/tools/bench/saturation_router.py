"""The router the saturation bench measures (cluster/tools/bench/saturation.py and
saturation_actor.py): a `router.router.Router` over R replicas (P:D 1:3, each replica's load
reported) and B blocks indexed, and prompts of a shared 1,024-token system prompt + 64-448 own
tokens, hashed (the ingress hashes; the router decides)."""

from __future__ import annotations

import random

from cluster.engine.kv_cache import hash_request_blocks
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy
from router.router import Router

SALT = b"bench-model"
SYSTEMS = 32  # distinct shared system prompts
SYSTEM_TOKENS = 1024


def build_router(replicas: int, blocks: int, rng: random.Random) -> tuple[Router, list[list[int]]]:
    """A Router over `replicas` (1 prefill per 3 decode, at least one of each) indexing `blocks`
    hashes in all: each replica holds 4 of the shared system prompts, the rest random hashes."""
    n_pre = max(1, replicas // 4)
    ids = [f"prefill-{i}" for i in range(n_pre)] + [f"decode-{i}" for i in range(replicas - n_pre)]
    systems = [[rng.randrange(32000) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEMS)]
    system_hashes = [hash_request_blocks(s, 16, SALT) for s in systems]
    now = [0.0]
    router = Router(RoutingPolicy(PolicyConfig(), random.Random(1)), clock=lambda: now[0])
    per_replica = max(0, blocks // replicas)
    for n, rid in enumerate(ids):
        own = [h for k in range(4) for h in system_hashes[(n + 7 * k) % SYSTEMS]][:per_replica]
        filler = [rng.randbytes(16) for _ in range(per_replica - len(own))]
        router.resync(rid, "inc", 0, own + filler)
        pool = "prefill" if n < n_pre else "decode"
        router.report_load(ReplicaLoad(rid, pool, 2000 + rng.randrange(4000), 8000, rng.randrange(32),
                                       rng.randrange(4), rng.randrange(4096) if pool == "prefill" else 0,
                                       0.03 + rng.random() * 0.01, 20000.0))
    return router, systems


def prompts(systems: list[list[int]], n: int, rng: random.Random) -> list[tuple[list[bytes], int]]:
    out = []
    for i in range(n):
        p = systems[i % SYSTEMS] + [rng.randrange(32000) for _ in range(rng.randrange(64, 449))]
        out.append((hash_request_blocks(p, 16, SALT), len(p)))
    return out
