"""The decode pool's Serve deployment: a replica that starts as a DecodeEngine, driven by its own
loop. Its calls (`generate`, and prefill's `prefill` and `release` should its role flip) are
EngineReplica's (cluster/serving/replica.py)."""

from __future__ import annotations

from cluster.serving.replica import EngineReplica, RoleSpec
from decode.engine import DecodeEngine


def make_decode_role(engine, transport, config) -> DecodeEngine:
    kv = config.kv_transfer
    return DecodeEngine(engine, transport, policy=kv.failure_policy, transfer_timeout_s=kv.timeout_s,
                        min_lease_left_s=kv.min_lease_left_s)


DECODE_ROLE = RoleSpec(make_decode_role, idle_poll_s=1.0)


class DecodeServer(EngineReplica):
    pool = "decode"
    home_role = DECODE_ROLE
