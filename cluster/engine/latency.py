"""Latencies a replica measures for the autoscaler (cluster/serving/autoscaling.py): time to first output
(TTFT on the prefill pool) and the interval between token-producing steps (ITL on the decode pool).

Each is a window drained once per report: the mean since the previous report. Both live on the
engine loop thread (the only thread that touches them); time is passed in, so tests need no clock.
"""

from __future__ import annotations


class MeanWindow:
    """Mean of the values observed since the last drain (0.0 when none)."""

    def __init__(self):
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        self._sum += value
        self._count += 1

    def drain(self) -> float:
        mean = self._sum / self._count if self._count else 0.0
        self._sum, self._count = 0.0, 0
        return mean


class FirstOutputTimer:
    """Time from a stream's submission to its first output.

    `drain` reports the larger of the mean over streams that got their first output since the
    last drain and the age of the oldest stream still waiting for one: a queue that has stopped
    moving must show up even though nothing completes in it."""

    def __init__(self):
        self._started: dict[str, float] = {}  # stream id -> submission time; insertion order = age
        self._done = MeanWindow()

    def start(self, request_id: str, now: float) -> None:
        self._started[request_id] = now

    def output(self, request_id: str, now: float) -> None:
        t0 = self._started.pop(request_id, None)
        if t0 is not None:
            self._done.observe(now - t0)

    def forget(self, request_id: str) -> None:
        """The stream ended without an output (aborted, or its submission failed)."""
        self._started.pop(request_id, None)

    def drain(self, now: float) -> float:
        oldest = now - next(iter(self._started.values())) if self._started else 0.0
        return max(self._done.drain(), oldest)


class TokenIntervals:
    """Intervals between consecutive engine steps that produced tokens: what a running request
    waits between its tokens. A step that produced none (idle, or only waiting on KV pulls) breaks
    the chain, so waits that are no request's inter-token time are not counted."""

    def __init__(self):
        self._window = MeanWindow()
        self._last: float | None = None  # end of the previous step, if it produced tokens
        self._tokens = 0

    def after_step(self, generated_tokens: int, now: float) -> None:
        """`generated_tokens`: the engine's running total of generated tokens."""
        if generated_tokens > self._tokens:
            if self._last is not None:
                self._window.observe(now - self._last)
            self._last = now
        else:
            self._last = None
        self._tokens = generated_tokens

    def idle(self) -> None:
        self._last = None

    def drain(self) -> float:
        return self._window.drain()
