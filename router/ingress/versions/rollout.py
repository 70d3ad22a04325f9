"""Rollouts at run time (issue 18): each model's live traffic split, changed without redeploying
anything (a manual `pdserve rollout set` / `rollback`, or the canary gate), and the gate itself.

- **Where the split lives**: the rollout actor (router/ingress/versions/rollout_actor.py) holds every
  model's current weights, starting from the config. Each ingress sends it its per-version request
  outcomes every `evaluate_s` and gets the split back when it changed; a change reaches every
  ingress within one period, and every version keeps its warm pools whatever its weight, so a
  rollback takes effect in about a second.
- **The gate**: over the last `window_s`, each version that takes traffic and is not the baseline
  (the first listed) is compared with the baseline on error rate, TTFT per prompt token and mean
  time per output token, over the requests it finished or failed (`Recorder.observe`): every
  failure of its replicas counts (failed, aborted, unavailable, or never taking a request before
  its deadline or `fault_tolerance.replica_wait_s`); a client's cancel, bad input or own
  deadline, and an overload refusal, are no sample; a truncated output is never a success. It trips when the canary has at least `min_requests` in the window and
  burns its error budget at `max_burn_rate` or more while failing more often than the baseline,
  or is `max_ttft_ratio` / `max_tpot_ratio` slower. A trip moves all of the canary's traffic to
  the baseline (or only logs, without auto_rollback). Every decision is logged with its numbers.
- **Blast radius**: `max_candidate_share` caps what the versions after the baseline may take
  together, whoever sets the split (the config or `pdserve rollout set`); a rollback is always allowed.
- **A config redeploy** that changes a model's weights wins over the run-time split (the split the
  config last set is remembered; an ingress restarted with the same config keeps the live one).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Callable

from cluster.config.models import RolloutOptions, candidate_share
from cluster.engine.outputs import FinishReason
from cluster.errors import InvalidRequestError
from router.ingress.status import ServingError

log = logging.getLogger(__name__)

MAX_DECISIONS = 256


@dataclass
class VersionStats:
    """Request outcomes of one model version over some time (summable)."""

    requests: int = 0
    errors: int = 0
    ttft_s: float = 0.0  # summed over ttft_n requests
    ttft_n: int = 0
    ttft_prompt_tokens: int = 0  # the prompt tokens of those ttft_n requests (TTFT grows with them)
    tpot_s: float = 0.0  # summed over tpot_n requests (those with 2 tokens or more)
    tpot_n: int = 0
    tokens: int = 0

    def add(self, other: "VersionStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_s / self.ttft_n if self.ttft_n else None

    @property
    def ttft_per_prompt_token_s(self) -> float | None:
        """TTFT per prompt token: what the gate compares, so a version sent longer prompts (a tenant's
        pinned probes, a shift in traffic) is not judged slower for it."""
        return self.ttft_s / self.ttft_prompt_tokens if self.ttft_prompt_tokens else None

    @property
    def mean_tpot_s(self) -> float | None:
        return self.tpot_s / self.tpot_n if self.tpot_n else None

    def summary(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "mean_ttft_ms": None if self.mean_ttft_s is None else round(self.mean_ttft_s * 1e3, 2),
                "mean_tpot_ms": None if self.mean_tpot_s is None else round(self.mean_tpot_s * 1e3, 2),
                "tokens": self.tokens}


Key = tuple[str, str]  # (model, version label)


class Recorder:
    """The ingress's side: each request's outcome by version, until the next sync drains them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.pending: dict[Key, VersionStats] = {}

    async def observe(self, key: Key, deltas: AsyncIterator) -> AsyncIterator:
        """One request's outcome, for the gate. A request the client got whole (its last delta
        ends it) is a sample, timed. One the version failed is a sample and an error: a
        ServingError that is a replica fault (its replicas failed it, aborted it, were
        unavailable, or never took it before its deadline), any other exception but the
        client's, or a stream that ends unfinished. Anything else is no sample: the client
        left or cancelled, its bad input, its own deadline reached on a replica that had it, a
        refusal. A truncated output never counts as a success."""
        start, first, last, d = self.clock(), None, None, None
        failed: bool | None = None  # None: no sample
        try:
            async with aclosing(deltas):  # closing this closes the request's stream at once
                async for d in deltas:
                    last = self.clock()
                    first = last if first is None else first
                    yield d
            failed = d is None or d.finish_reason in (None, FinishReason.CANCELLED)
        except ServingError as e:
            failed = True if e.replica_fault else None
            raise
        except InvalidRequestError:
            raise  # the client's input (a cancel or a client that left: GeneratorExit, CancelledError)
        except Exception:
            failed = True  # a failure of ours with no code: INTERNAL at the edge
            raise
        finally:
            if failed is not None:
                self._record(key, failed, start, first, last, d)

    def _record(self, key: Key, failed: bool, start: float, first: float | None, last: float | None, d) -> None:
        s = self.pending.setdefault(key, VersionStats())
        s.requests += 1
        if failed:
            s.errors += 1
            return
        s.tokens += d.completion_tokens
        s.ttft_s += first - start
        s.ttft_n += 1
        s.ttft_prompt_tokens += max(d.prompt_tokens, 1)
        if d.completion_tokens >= 2:
            s.tpot_s += (last - first) / (d.completion_tokens - 1)
            s.tpot_n += 1

    def drain(self) -> dict[Key, VersionStats]:
        out, self.pending = self.pending, {}
        return out


@dataclass
class ModelRollout:
    baseline: str
    weights: dict[str, float]
    options: RolloutOptions
    configured: dict[str, float]  # the weights the config last set
    windows: dict[str, deque] = field(default_factory=dict)  # label -> (time, VersionStats) reports
    last_eval: float = float("-inf")


class Rollouts:
    """The actor's state: every model's live split, the recent outcomes by version, the gate and
    the decision log. `models`: name -> (version weights in config order, RolloutOptions)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.models: dict[str, ModelRollout] = {}
        self.generation = 0
        self.decisions: deque[dict] = deque(maxlen=MAX_DECISIONS)

    def configure(self, models: dict[str, tuple[dict[str, float], RolloutOptions]]) -> None:
        """From an ingress's config: a model new here, or whose configured weights changed (a
        redeploy), takes the config's split; otherwise the live split stays."""
        for name, (weights, options) in models.items():
            m = self.models.get(name)
            if m is not None and m.configured == weights:
                self.models[name] = ModelRollout(m.baseline, m.weights, options, weights, m.windows, m.last_eval)
                continue
            self.models[name] = ModelRollout(next(iter(weights)), dict(weights), options, dict(weights))
            self.generation += 1
            self._log(name, "configured", "the config's split", weights=dict(weights))

    def splits(self) -> dict[str, dict[str, float]]:
        return {name: dict(m.weights) for name, m in self.models.items()}

    def set_split(self, model: str, weights: dict[str, float], reason: str, action: str = "set") -> dict:
        m = self._model(model)
        unknown = set(weights) - set(m.configured)
        if unknown:
            raise ValueError(f"model {model!r} has no version(s) {sorted(unknown)} (versions: {list(m.configured)})")
        if any(not w >= 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
        new = {label: float(weights.get(label, 0.0)) for label in m.configured}
        if (share := candidate_share(new)) > m.options.max_candidate_share + 1e-9:
            raise ValueError(f"the versions after the baseline ({m.baseline}) would take {share:.1%} of {model}'s "
                             f"traffic, over rollout.max_candidate_share {m.options.max_candidate_share:.1%}")
        m.weights = new
        self.generation += 1
        return self._log(model, action, reason, weights=dict(m.weights))

    def rollback(self, model: str, reason: str) -> dict:
        """All of the model's traffic to its baseline (its first version)."""
        m = self._model(model)
        return self.set_split(model, {m.baseline: 1.0}, reason, action="rollback")

    def report(self, stats: dict[Key, VersionStats]) -> list[dict]:
        """One ingress's outcomes since its last report; evaluates the gates that are due."""
        now = self.clock()
        for (model, label), s in stats.items():
            m = self.models.get(model)
            if m is not None:
                m.windows.setdefault(label, deque()).append((now, s))
        return [d for name in list(self.models) if (d := self.evaluate(name, now)) is not None]

    def window(self, model: str, now: float | None = None) -> dict[str, VersionStats]:
        m = self._model(model)
        now = self.clock() if now is None else now
        out = {}
        for label, reports in m.windows.items():
            while reports and reports[0][0] < now - m.options.window_s:
                reports.popleft()
            total = VersionStats()
            for _, s in reports:
                total.add(s)
            out[label] = total
        return out

    def evaluate(self, model: str, now: float) -> dict | None:
        m = self.models[model]
        if now - m.last_eval < m.options.evaluate_s:
            return None
        m.last_eval = now
        o = m.options
        stats = self.window(model, now)
        base = stats.get(m.baseline, VersionStats())
        for label, weight in m.weights.items():
            s = stats.get(label)
            if label == m.baseline or weight <= 0 or s is None or s.requests < o.min_requests:
                continue
            why = self._tripped(s, base, o)
            if why is None:
                continue
            numbers = {"canary": {label: s.summary()}, "baseline": {m.baseline: base.summary()},
                       "window_s": o.window_s}
            if not o.auto_rollback:
                return self._log(model, "gate tripped (auto_rollback off)", why, **numbers)
            m.weights = {v: (1.0 if v == m.baseline else 0.0) for v in m.weights}
            m.windows.clear()  # the next judgement starts from the new split
            self.generation += 1
            return self._log(model, "rollback", f"gate: {why}", weights=dict(m.weights), **numbers)
        return None

    @staticmethod
    def _tripped(canary: VersionStats, base: VersionStats, o: RolloutOptions) -> str | None:
        burn = canary.error_rate / (1 - o.error_slo)
        if burn >= o.max_burn_rate and canary.error_rate > base.error_rate:
            return (f"error rate {canary.error_rate:.3f} burns the budget ({1 - o.error_slo:.3f}) "
                    f"{burn:.1f}x (max {o.max_burn_rate:g}x; baseline {base.error_rate:.3f})")
        for name, c, b, cap in (("TTFT per prompt token", canary.ttft_per_prompt_token_s,
                                 base.ttft_per_prompt_token_s, o.max_ttft_ratio),
                                ("TPOT", canary.mean_tpot_s, base.mean_tpot_s, o.max_tpot_ratio)):
            if c is not None and b is not None and b > 0 and c / b >= cap:
                return f"mean {name} {c * 1e3:.1f} ms is {c / b:.1f}x the baseline's {b * 1e3:.1f} ms (max {cap:g}x)"
        return None

    def status(self) -> dict:
        now = self.clock()
        return {"generation": self.generation,
                "models": {name: {"baseline": m.baseline, "weights": dict(m.weights), "configured": dict(m.configured),
                                  "window": {label: s.summary() for label, s in self.window(name, now).items()}}
                           for name, m in self.models.items()},
                "decisions": list(self.decisions)}

    def _model(self, model: str) -> ModelRollout:
        if model not in self.models:
            raise ValueError(f"model {model!r} does not exist (models: {list(self.models)})")
        return self.models[model]

    def _log(self, model: str, action: str, reason: str, **numbers) -> dict:
        decision = {"time": self.clock(), "model": model, "action": action, "reason": reason, **numbers}
        self.decisions.append(decision)
        log.warning("rollout of %s: %s (%s) %s", model, action, reason, numbers)
        return decision
