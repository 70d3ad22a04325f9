"""The guardrail classifier deployment: its own Serve deployment with its own CPUs, so a check
never shares an engine's step. The ingress calls `classify(text) -> score in [0, 1]`
(router/ingress/gateway/guardrails.py: ClassifierCheck, bounded by the policy's timeout).

`KeywordClassifierStandIn` is a RULE-BASED STAND-IN for a classifier model: it scores 1.0 when one
of its words occurs (whole word, case-insensitive), else 0.0. A model-backed classifier keeps the
same method and replaces the scoring. `stall` (only with fault_tolerance.fault_injection) makes
the next calls hang, for drills of a slow or dead classifier; `stalled` counts the calls hanging."""

from __future__ import annotations

import asyncio
import re

from cluster.config import AppConfig


class KeywordClassifierStandIn:
    def __init__(self, config: dict):
        cfg = AppConfig.model_validate(config)
        self.options = cfg.guardrail_classifier
        self.fault_injection = cfg.fault_tolerance.fault_injection
        words = sorted({w.strip() for w in self.options.words if w.strip()}, key=len, reverse=True)
        self.pattern = re.compile(r"(?i)(?<!\w)(?:" + "|".join(map(re.escape, words)) + r")(?!\w)") if words else None
        self._stall_until = 0.0
        self._stalled = 0  # calls waiting out a stall

    async def classify(self, text: str) -> float:
        if len(text) > self.options.max_text_chars:
            raise ValueError(f"text of {len(text)} characters exceeds max_text_chars {self.options.max_text_chars}")
        loop = asyncio.get_running_loop()
        if loop.time() < self._stall_until:
            self._stalled += 1
            try:
                await asyncio.sleep(self._stall_until - loop.time())
            finally:
                self._stalled -= 1
        return 1.0 if self.pattern is not None and self.pattern.search(text) else 0.0

    async def stall(self, seconds: float) -> None:
        """Calls in the next `seconds` wait until then (fault injection only)."""
        if not self.fault_injection:
            raise RuntimeError("fault injection is off (fault_tolerance.fault_injection)")
        self._stall_until = asyncio.get_running_loop().time() + seconds

    async def stalled(self) -> int:
        """How many calls are waiting out a stall now (a drill knows its calls are in flight)."""
        return self._stalled
