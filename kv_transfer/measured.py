"""NixlTransport with what benchmarks read, applied from outside (gpt-fast style): NIXL's count of
the descriptors each READ used (its telemetry, after it merged adjacent blocks) and each pull's
phases (posting, the wait for its first poll, the polls). Serving runs the plain transport, whose
poll carries none of it; cluster/tools/bench/kv_transfer.py and the tests that count descriptors
install this one."""

from __future__ import annotations

import time

from kv_transfer.handle import KVHandle
from kv_transfer.rank_reads import MappedPull
from kv_transfer.transport import NixlTransport, PendingPull


class MeasuredTransport(NixlTransport):
    """`telemetry`: NIXL's telemetry on (stats.descriptors_used counted); the phases are recorded
    either way, in stats.last_pull_phases: (posting s, posted to first poll s, polls)."""

    def __init__(self, *args, telemetry: bool = True, **kwargs):
        self.capture_telemetry = telemetry
        super().__init__(*args, **kwargs)

    def start_pull(self, handle: KVHandle, remote_blocks: list[int], local_blocks: list[int],
                   timeout_s: float) -> PendingPull:
        pull = super().start_pull(handle, remote_blocks, local_blocks, timeout_s)
        if pull.conversion is None and not isinstance(pull.handle, MappedPull):  # posted: a plain READ
            pull.posted = time.monotonic()
        return pull

    def _post_conversion(self, pull: PendingPull) -> None:
        super()._post_conversion(pull)
        if pull.handle is not None:
            pull.posted = time.monotonic()

    def poll(self, pull: PendingPull) -> bool:
        if not pull.polls:
            pull.first_poll = time.monotonic()
        pull.polls += 1
        done = super().poll(pull)
        if done and pull.posted:
            self.stats.last_pull_phases = (pull.posted - pull.started, pull.first_poll - pull.posted, pull.polls)
        return done

    def _before_release(self, pull: PendingPull) -> None:
        if self.capture_telemetry and not isinstance(pull.handle, MappedPull):  # descriptors NIXL used (merged)
            self.stats.descriptors_used += self.agent.get_xfer_telemetry(pull.handle).descCount
