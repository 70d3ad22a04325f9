"""What an engine step and a request's end tell telemetry, as plain numbers.

The engine calls `step()` once per step and `finished()` for every request it ends (only when a
probe is set: with telemetry off the engine pays one `is None` check per step). The probe stamps
the request's phase times on the Request itself (first scheduled, first token, last token), so
nothing is kept per request here and nothing can leak; it buffers per-step and per-token numbers
until the replica's exporter drains them (cluster/telemetry/replica.py), on the same thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.request import Request
    from cluster.engine.scheduler import SchedulerOutput


@dataclass
class ProbeBatch:
    """Everything observed since the previous drain."""

    steps: list[tuple[int, int]] = field(default_factory=list)  # (sequences, tokens) per step
    inter_token_s: list[float] = field(default_factory=list)  # one per token after a request's first here
    finished: list[tuple["Request", float]] = field(default_factory=list)  # (request, monotonic end)


class EngineProbe:
    def __init__(self):
        self._batch = ProbeBatch()

    def step(self, out: "SchedulerOutput", ended: float, duration_s: float) -> None:
        """One engine step that ran `out` and ended at `ended` (monotonic) after `duration_s`."""
        batch = self._batch
        batch.steps.append((len(out.chunks), out.num_tokens))
        started = ended - duration_s
        for chunk in out.chunks:
            req = chunk.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = started
            if not chunk.samples:
                continue
            if req.last_token_time is not None:
                batch.inter_token_s.append(ended - req.last_token_time)
            elif req.num_output_tokens == 1:  # its first token is sampled here (not imported)
                req.first_token_time = ended
            req.last_token_time = ended

    def finished(self, req: "Request") -> None:
        self._batch.finished.append((req, time.monotonic()))

    def drain(self) -> ProbeBatch:
        batch, self._batch = self._batch, ProbeBatch()
        return batch
