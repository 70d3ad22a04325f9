"""What every engine replica shares: building its engine from the app config, and reporting its
load to the registry (from the loop thread, at most once a second, fire-and-forget)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Literal

from cluster.app_config import AppConfig
from cluster.config import EngineConfig
from cluster.engine import LLMEngine


def build_engine(config: AppConfig, pool: Literal["prefill", "decode"]) -> LLMEngine:
    opts = config.engine_for(pool)
    return LLMEngine(EngineConfig(model=config.model, **opts.model_dump()))


def engine_load(engine: LLMEngine) -> dict:
    sched = engine.scheduler
    return {
        "free_blocks": engine.kv.num_free_blocks,
        "total_blocks": engine.kv.num_blocks,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "importing": len(sched.importing),
        "leased": len(sched.leased),
        "queued_prefill_tokens": sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        "last_step_ms": round(engine.stats.last_step_s * 1e3, 3),
        "steps": engine.stats.steps,
        "generation_tokens": engine.stats.generation_tokens,
        "preemptions": engine.stats.preemptions,
    }


class ReportingCore:
    """Wraps a role core (prefill or decode) so its loop also reports load to the registry."""

    def __init__(self, core, replica_id: str, pool: str, registry, interval_s: float = 1.0):
        self.core = core
        self.engine = core.engine
        self.replica_id = replica_id
        self.pool = pool
        self.registry = registry
        self.interval_s = interval_s
        self._next = 0.0
        self._inner_service = getattr(core, "service", None)

    def step(self):
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def abort(self, request_id: str):
        return self.core.abort(request_id)

    def service(self) -> None:
        if self._inner_service is not None:
            self._inner_service()
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self.registry.report.remote(self.replica_id, self.load())

    def load(self) -> dict:
        transfer = asdict(self.core.transport.stats)
        transfer["pull_seconds"] = len(transfer["pull_seconds"])
        return {"pool": self.pool, **engine_load(self.engine), "transfer": transfer}
