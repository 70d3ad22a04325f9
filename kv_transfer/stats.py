"""Plain transfer counters per engine; the telemetry layer turns them into metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferStats:
    # decode side
    pulls_ok: int = 0
    pulls_failed: int = 0
    pulls_timed_out: int = 0
    fallbacks_recompute: int = 0
    blocks_pulled: int = 0
    blocks_reused: int = 0  # prompt blocks found in our own prefix cache: not pulled
    bytes_pulled: int = 0
    descriptors_used: int = 0  # counted by MeasuredTransport with telemetry on (NIXL merges adjacent blocks)
    pull_seconds_sum: float = 0.0  # over pulls_ok; constant size, so reporting stays cheap
    pull_seconds_max: float = 0.0
    last_pull_s: float = 0.0
    # the last pull's (posting s, posted -> first poll s, polls): MeasuredTransport only (benchmarks)
    last_pull_phases: tuple[float, float, int] = (0.0, 0.0, 0)
    peer_refreshes: int = 0  # cached remote agent replaced (peer restarted)
    pulls_refused_lease: int = 0  # handle's lease too close to expiry to pull: recomputed instead
    pulls_abandoned: int = 0  # READs left in flight by an abort or failure: their blocks quarantined
    abandoned_settled: int = 0  # of those, settled since (quarantine released)
    blocks_converted: int = 0  # pulled from a pool of another KV dtype or scales (kv_transfer/convert.py)
    # prefill side
    leases_granted: int = 0
    leases_from_host: int = 0  # of those, served from the host tier (kv_tiers.lease_from_host)
    leases_released: int = 0
    leases_expired: int = 0
    grace_blocks_released: int = 0  # blocks returned to the pool after a release/expiry grace period
