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

What the freeze leaves is still a pause: the ingress's full collections while serving took 83-174
ms of wall time in issue 39's burst, and a collection stops every thread, the gRPC transport's that
refuses calls on arrival included. `FullCollections` therefore takes generation 2 off the
collector's automatic schedule while the process serves (its threshold raised to DEFERRED_FACTOR
times the default, a safety net only) and runs it itself: at a quiet moment (nothing in flight, no
call arriving, for `quiet_s`), and in any case `max_interval_s` after gen2 first held anything new,
even under load, so cyclic garbage that outlives the young generations stays bounded. Generations
0 and 1 stay automatic: they walk only what is young, a few milliseconds.

That schedule is CPython's generational collector's (3.10-3.13; requires-python admits later
ones): `set_threshold`'s third value triggers gen2 and `get_count()[2]` counts the gen1 collections
since the last full one. Python 3.14's incremental collector has two generations (young, old):
`set_threshold` ignores a third value (`get_threshold()[2]` is always 0), and each young
collection scans an increment of the old generation, which already bounds the pauses this
deferral is for. `generational_collector()` asks the running interpreter (it sets a third
threshold and reads it back); where it is not generational nothing is deferred (logged), and the
collector keeps its own schedule.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

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


# ---- full collections at quiet moments --------------------------------------------------------

DEFERRED_FACTOR = 100  # gen2's threshold while deferred: x the default (10 gen1 collections -> 1,000)
_PROBE = 4242  # a third threshold no one sets: read back only by a collector that keeps it


def generational_collector(gc_module=gc) -> bool:
    """True when the collector's third threshold is kept, i.e. it has the generation 2 this
    deferral is written for (CPython <= 3.13); False under 3.14's incremental collector, which
    ignores it. The thresholds are as they were after the call."""
    saved = gc_module.get_threshold()
    try:
        gc_module.set_threshold(saved[0], saved[1], _PROBE)
        return len(gc_module.get_threshold()) == 3 and gc_module.get_threshold()[2] == _PROBE
    finally:
        gc_module.set_threshold(*saved)


@dataclass
class FullCollectionStats:
    """What `FullCollections` did: its own collections (idle: at a quiet moment; forced: after
    `max_interval_s` under load) with their wall time; `deferred`: how many times gen2 fell due
    by the default threshold while the process was busy (once per collection cycle); `freed`: the
    unreachable objects they found (what deferring let accumulate)."""
    idle: GenerationPauses = field(default_factory=GenerationPauses)
    forced: GenerationPauses = field(default_factory=GenerationPauses)
    deferred: int = 0
    freed: int = 0


FULL = FullCollectionStats()  # this process's (zeros while nothing defers)


def defer_enabled() -> bool:
    """PDSERVE_GC_DEFER=0 leaves gen2 on the collector's own schedule (to compare; deferral is on by default)."""
    return os.environ.get("PDSERVE_GC_DEFER", "1") != "0"


class FullCollections:
    """Generation-2 collections run by `tick()`, not by the collector in the middle of traffic.

    `idle()` answers "nothing in flight and no call arrived since you last asked"; a collection
    runs once it has answered yes for `quiet_s` and gen2 holds anything new (a gen1 collection
    since the last full one: gc.get_count()[2] > 0), or `max_interval_s` after gen2 first held
    anything new, whatever `idle()` says. `tick()` runs every `period_s` on the event loop
    (`run()`); `clock` and `collect` are injectable for tests. `start()` raises gen2's threshold,
    `stop()` puts back the thresholds it found. Under a collector that is not generational
    (`generational_collector`, e.g. 3.14's incremental one) `start()` defers nothing."""

    def __init__(self, idle: Callable[[], bool], quiet_s: float = 0.5, max_interval_s: float = 60.0,
                 period_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 collect: Callable[[int], int] = gc.collect, stats: FullCollectionStats | None = None,
                 gc_module=gc):
        self.idle, self.quiet_s, self.max_interval_s, self.period_s = idle, quiet_s, max_interval_s, period_s
        self.clock, self.collect, self.gc = clock, collect, gc_module
        self.stats = stats if stats is not None else FullCollectionStats()
        self._saved: tuple[int, int, int] | None = None  # the thresholds start() found
        self._idle_since: float | None = None
        self._dirty_since: float | None = None  # first tick that saw gen2 hold anything new
        self._deferral_counted = False

    @property
    def deferring(self) -> bool:
        return self._saved is not None

    def start(self) -> FullCollections:
        if self._saved is None and generational_collector(self.gc):
            self._saved = self.gc.get_threshold()
            t0, t1, t2 = self._saved
            self.gc.set_threshold(t0, t1, max(1, t2) * DEFERRED_FACTOR)
            self._dirty_since = self.clock() if self.gc.get_count()[2] > 0 else None
        return self

    def stop(self) -> None:
        if self._saved is not None:
            self.gc.set_threshold(*self._saved)
            self._saved = None

    def tick(self) -> str | None:
        """One check: "idle" or "forced" when it collected, else None."""
        if self._saved is None:
            return None
        now = self.clock()
        pending = self.gc.get_count()[2]  # gen1 collections since the last full one
        if pending == 0:  # nothing new in gen2 (or someone else collected it)
            self._dirty_since, self._deferral_counted = None, False
        elif self._dirty_since is None:
            self._dirty_since = now
        if self.idle():
            if self._idle_since is None:
                self._idle_since = now
        else:
            self._idle_since = None
        if pending == 0:
            return None
        if self._idle_since is not None and now - self._idle_since >= self.quiet_s:
            return self._collect("idle", self.stats.idle)
        if now - self._dirty_since >= self.max_interval_s:
            return self._collect("forced", self.stats.forced)
        if pending > self._saved[2] and not self._deferral_counted:  # the collector would have run it by now
            self.stats.deferred += 1
            self._deferral_counted = True
        return None

    def _collect(self, why: str, pauses: GenerationPauses) -> str:
        started = time.perf_counter()
        found = self.collect(2)
        pause = time.perf_counter() - started
        self.stats.freed += found or 0
        pauses.count += 1
        pauses.total_s += pause
        pauses.max_s = max(pauses.max_s, pause)
        self._dirty_since, self._deferral_counted = None, False
        return why

    async def run(self) -> None:
        """tick() every period_s until cancelled; the thresholds go back when it ends."""
        try:
            while True:
                await asyncio.sleep(self.period_s)
                self.tick()
        finally:
            self.stop()


def idle_from(activity: Callable[[], tuple[int, int]]) -> Callable[[], bool]:
    """An `idle()` for FullCollections from `activity()` = (calls arrived so far, calls in flight
    now): idle when none is in flight and none arrived since the previous question."""
    seen: int | None = None

    def idle() -> bool:
        nonlocal seen
        arrived, inflight = activity()
        quiet = arrived == seen and inflight == 0
        seen = arrived
        return quiet
    return idle


def collect_when_quiet(idle: Callable[[], bool]) -> asyncio.Task | None:
    """In a serving process, after settle_after_start: gen2 collections at quiet moments (unless
    PDSERVE_GC_DEFER=0), on the running event loop, into FULL. Returns the task (cancel it to stop
    and restore the collector's thresholds)."""
    if not defer_enabled():
        return None
    collections = FullCollections(idle, stats=FULL).start()
    if not collections.deferring:
        log.info("gc: the collector is not generational (Python %s: incremental); full collections are left to "
                 "its own schedule, whose increments bound the pauses", sys.version.split()[0])
        return None
    log.info("gc: full collections deferred to quiet moments (quiet %.1f s, at most every %.0f s under load)",
             collections.quiet_s, collections.max_interval_s)
    task = asyncio.get_running_loop().create_task(collections.run(), name="pdserve-gc-full")
    task.add_done_callback(lambda _: collections.stop())  # also when cancelled before its first step
    return task
