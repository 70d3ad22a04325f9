"""Python's garbage collector on the serving path: what its pauses cost, and keeping them short.

A full (generation 2) collection walks every tracked object the process holds: in an ingress
that imported Ray, transformers and a tokenizer that is a few hundred thousand objects, tens of
milliseconds of CPU during which the event loop answers no one; on a shared, busy host the same
pause can take several times that in wall time. Traffic that allocates fast (token relays, a
flood of refusals) makes gen2 collections frequent, and a quiet tenant's request that lands on
one pays the whole pause in its TTFT.

`freeze_after_start` collects once and moves every object that survived start-up into the
permanent generation (`gc.freeze`, Python >= 3.7): later collections never walk the modules,
the model config, the tokenizer or Ray's own state again, only what requests allocate. Cycles
among frozen objects are never freed; start-up objects live for the whole process anyway.
`GcPauses` times every collection (gc.callbacks) per generation, for /metrics and benchmarks.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class GenerationPauses:
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class GcPauses:
    """Wall time of every collection, by generation, since install()."""

    def __init__(self) -> None:
        self.by_generation = [GenerationPauses() for _ in range(3)]
        self._started: float | None = None
        self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self._started = None
            g = self.by_generation[min(info.get("generation", 2), 2)]
            g.count += 1
            g.total_s += pause
            g.max_s = max(g.max_s, pause)

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def summary(self) -> dict[int, tuple[int, float, float]]:
        """{generation: (collections, total seconds, longest seconds)}."""
        return {gen: (p.count, p.total_s, p.max_s) for gen, p in enumerate(self.by_generation)}

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False


PAUSES = GcPauses()  # this process's; install() once it serves


def freeze_enabled() -> bool:
    """PDSERVE_GC_FREEZE=0 keeps the default collector (to compare; the freeze is on by default)."""
    return os.environ.get("PDSERVE_GC_FREEZE", "1") != "0"


def freeze_after_start() -> int:
    """Collect, then freeze what survived: the objects start-up made are never walked again.
    Returns how many objects are frozen now."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: froze %d start-up objects (collections walk only what requests allocate)", frozen)
    return frozen


def settle_after_start() -> None:
    """A serving process's last start-up step: freeze (unless PDSERVE_GC_FREEZE=0), then time every
    collection from here on into PAUSES."""
    if freeze_enabled():
        freeze_after_start()
    PAUSES.install()

