"""Whether drafts pay at the current decode batch, from measured step times.

A decode step of b requests makes b tokens in T(b) seconds. Giving d of them drafts makes it
cost T(b) + d * c(b): each drafted request leaves the batched decode attention for a multi-token
chunk of its own and its verification samples several rows. A drafted request with acceptance r
and k drafts wins E = r + r^2 + ... + r^k tokens on average (i.i.d. acceptance per draft). At the
step's rate of b / T(b) tokens a second, those E tokens are worth E * T(b) / b seconds, so a
request's drafts pay when

    E > min_gain(b) = b * c(b) / T(b)

which rises with the batch: c(b) falls more slowly than T(b) / b (measured on the demo model in
docs/benchmarks.md, "Speculative decoding"). T(b) is an EWMA over decode-only steps at batch b
without drafts; c(b) over decode-only steps at batch b with d drafted requests, each giving the
sample (seconds - T(b)) / d. Until both are known at b, drafts go ahead: that is how c(b) is
measured. Where drafts lost, a request is held back; every PROBE_EVERY held steps at b, one step
drafts anyway, so c(b) follows the machine (a quieter host, a new batch mix).

Time is passed in (seconds per step), so the decision is a pure function of what was observed.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA = 0.2  # weight of the latest step in T(b) and c(b)
PROBE_EVERY = 64  # held steps at a batch size before one step drafts anyway


def expected_accepted(r: float, k: int) -> float:
    """Mean accepted drafts of k, each accepted with probability r while all before it were."""
    return float(k) if r >= 1 else r * (1 - r ** k) / (1 - r)


@dataclass
class _Batch:
    plain_s: float | None = None  # T(b)
    extra_s: float | None = None  # c(b), per drafted request
    held: int = 0  # steps with a request held back since the last probe


class StepCosts:
    def __init__(self):
        self._by_batch: dict[int, _Batch] = {}

    def observe(self, batch: int, drafted: int, seconds: float) -> None:
        """A decode-only step of `batch` requests, `drafted` of them with drafts."""
        s = self._by_batch.setdefault(batch, _Batch())
        if not drafted:
            s.plain_s = seconds if s.plain_s is None else (1 - EWMA) * s.plain_s + EWMA * seconds
        elif s.plain_s is not None:
            extra = (seconds - s.plain_s) / drafted
            s.extra_s = extra if s.extra_s is None else (1 - EWMA) * s.extra_s + EWMA * extra

    def min_gain(self, batch: int) -> float | None:
        """Expected accepted drafts a request needs for its drafts to pay at this batch size;
        None: not measured yet, or a probe is due (drafts go ahead)."""
        s = self._by_batch.get(batch)
        if s is None or s.plain_s is None or s.extra_s is None or s.held >= PROBE_EVERY:
            return None
        return batch * max(0.0, s.extra_s) / s.plain_s

    def held_back(self, batch: int) -> None:
        """A step at this batch size held at least one request back."""
        self._by_batch.setdefault(batch, _Batch()).held += 1

    def probed(self, batch: int) -> None:
        s = self._by_batch.get(batch)
        if s is not None and s.held >= PROBE_EVERY:
            s.held = 0

    def estimate(self, batch: int) -> tuple[float | None, float | None]:
        """(T(b), c(b)) in seconds, for reports and tests."""
        s = self._by_batch.get(batch, _Batch())
        return s.plain_s, s.extra_s
