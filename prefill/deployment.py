"""The prefill pool's Serve deployment: a replica that starts as a PrefillEngine, driven by its own
loop. Its calls (`prefill`, `release`, and decode's `generate` should its role flip) are
EngineReplica's (cluster/serving/replica.py)."""

from __future__ import annotations

from cluster.serving.replica import EngineReplica, RoleSpec
from prefill.engine import PrefillEngine


def make_prefill_role(engine, transport, config) -> PrefillEngine:
    kv = config.kv_transfer
    return PrefillEngine(engine, transport, lease_s=kv.lease_s, release_grace_s=kv.release_grace_s)


# idle wake-ups serve lease expiry and completion notifications
PREFILL_ROLE = RoleSpec(make_prefill_role, idle_poll_s=0.05)


class PrefillServer(EngineReplica):
    pool = "prefill"
    home_role = PREFILL_ROLE
