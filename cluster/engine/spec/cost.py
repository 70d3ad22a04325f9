"""How many drafts a decode step should verify, from this replica's measured step times.

A decode step's time is mostly a function of the rows it computes: b decoding requests with n
drafts between them compute b + n rows, and on a CPU (or a GPU past its memory-bound region) the
linears' cost grows with the rows, with jumps where a kernel hands over to another (model/ops.py:
the small-row linear up to SMALL_ROWS rows, torch's GEMM above). So the replica keeps T(b, rows):
an EWMA of decode-only steps' seconds per (batch, rows). A draft is worth its chance of being
accepted: a request with acceptance rate r gets its j-th draft accepted with probability r^j (i.i.d.
per draft, every draft before it accepted). The plan sorts the step's candidate drafts by that
probability, and drafting the n best makes the step produce b + G(n) tokens (G(n): the sum of their
probabilities) in T(b, b + n) seconds; it picks the n with the most tokens a second. That prices the
fixed cost of leaving a kernel (the first drafts at a batch pay the jump, the next ones ride on it),
so at a batch where drafts pay only when most requests draft, they all draft.

Pricing: T at a row count between two measured ones is interpolated linearly; beyond the largest
measured one it is extrapolated along the last segment (never falling). Exploration: at a batch with
nothing measured past the plain step, the step drafts every candidate (that measures the far end);
with the far end but no plain step measured, it drafts none. Every PROBE_EVERY plans at a batch, the
end the plan has not been choosing is measured again, so the table follows the machine.

Time is passed in (seconds per step), so the plan is a pure function of what was observed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

EWMA = 0.2  # weight of the latest step in T(b, rows)
PROBE_EVERY = 64  # plans at a batch size between two probes of the end the plan is not choosing


def draft_probabilities(acceptance: Sequence[float], ks: Sequence[int]) -> list[tuple[float, int]]:
    """Every candidate draft as (probability it is accepted, its request's index), best first:
    request i's j-th draft (j = 1..ks[i]) is accepted with probability acceptance[i] ** j."""
    cands = [(r ** j, i) for i, (r, k) in enumerate(zip(acceptance, ks)) for j in range(1, k + 1)]
    cands.sort(key=lambda c: -c[0])  # stable: a request's own drafts stay in order
    return cands


@dataclass
class _Batch:
    seconds: dict[int, float] = field(default_factory=dict)  # rows -> EWMA step seconds
    plans: int = 0  # since the last probe
    drafting: bool = False  # the latest plan drafted at least half of what it could


class StepCosts:
    def __init__(self):
        self._by_batch: dict[int, _Batch] = {}

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A decode-only step of `batch` requests that computed `rows` rows (batch + drafts)."""
        table = self._by_batch.setdefault(batch, _Batch()).seconds
        old = table.get(rows)
        table[rows] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds

    def seconds(self, batch: int, rows: int) -> float | None:
        """T(batch, rows): measured, interpolated, or extrapolated; None with fewer than two row
        counts measured at this batch (unless `rows` is one of them)."""
        table = self._by_batch.get(batch, _Batch()).seconds
        return _price(table, sorted(table), rows)

    def plan(self, batch: int, probabilities: Sequence[float]) -> int:
        """How many of the step's candidate drafts to verify: the n best of `probabilities` (each
        a draft's chance of acceptance, best first) that give the most tokens a second."""
        n_max = len(probabilities)
        if n_max == 0:
            return 0
        s = self._by_batch.setdefault(batch, _Batch())
        s.plans += 1
        known = s.seconds
        if batch not in known or len(known) < 2:  # explore: the far end first, then the plain step
            return 0 if known and batch not in known else n_max
        if s.plans >= PROBE_EVERY:  # measure again the end the plan has not been choosing
            s.plans = 0
            return 0 if s.drafting else n_max
        xs = sorted(known)
        best_rate, n, gain = batch / known[batch], 0, 0.0
        for i, p in enumerate(probabilities, 1):
            gain += p
            rate = (batch + gain) / _price(known, xs, batch + i)
            if rate > best_rate:
                best_rate, n = rate, i
        s.drafting = 2 * n >= n_max
        return n

    def table(self, batch: int) -> dict[int, float]:
        """The measured T(batch, rows), rows -> seconds, for reports and tests."""
        return dict(sorted(self._by_batch.get(batch, _Batch()).seconds.items()))


def _price(table: dict[int, float], xs: list[int], rows: int) -> float | None:
    """table[rows], else linear between the measured row counts `xs` (sorted) around it, else
    along the last segment past the largest (never falling); None with fewer than two."""
    if rows in table:
        return table[rows]
    if len(xs) < 2:
        return None
    i = bisect.bisect_left(xs, rows)
    lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i == len(xs) else (xs[i - 1], xs[i])
    slope = (table[hi] - table[lo]) / (hi - lo)
    if i == len(xs):
        return table[hi] + max(slope, 0.0) * (rows - hi)
    return max(table[lo] + slope * (rows - lo), 1e-9)
