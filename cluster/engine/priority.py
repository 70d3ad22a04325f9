"""OS priority (niceness) of this process's threads: the front door is latency work, the engines
are throughput work (docs/architecture.md, "CPU priority").

On Linux niceness belongs to a thread, and a thread starts with its starter's. Ray starts its
worker processes' Python threads at niceness 15 (its `worker_niceness`, so that its own daemons win
the CPU); its C++ threads, started before, stay at 0. Lowering priority (a higher number) is always
allowed; raising it needs CAP_SYS_NICE or an RLIMIT_NICE that allows it, and is refused otherwise:
the thread keeps what it has, and the caller is told.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread alone
        return [threading.get_native_id()]


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread niceness `nice` if that is lower priority than it has; threads it
    starts later inherit it, which includes the OpenMP workers torch starts for this thread's
    first parallel region (each master thread has its own pool). Raising priority is never
    attempted."""
    tid = threading.get_native_id()
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as e:  # not Linux, or refused: run at the inherited priority
        log.warning("could not lower the engine thread's priority to nice %d: %s", nice, e)


def raise_process_priority(nice: int, who: str) -> tuple[int, int]:
    """Every thread of this process that runs at a niceness above `nice` (lower priority) to
    `nice`; threads already at `nice` or below keep theirs (where Ray starts its workers at 0, they
    stay at 0). Returns (threads at `nice` or below now, threads refused): raising priority without
    the privilege is refused, and those threads keep theirs (logged once, naming `who` and the
    remedy)."""
    done = refused = 0
    error: OSError | None = None
    for tid in _tids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except (PermissionError, OSError, AttributeError) as e:
            refused += 1
            error = error or e
    if refused:
        log.warning("%s: could not raise %d of %d threads to nice %d (%s): they keep Ray's worker niceness. "
                    "Grant CAP_SYS_NICE, or start Ray with RAY_worker_niceness at or below it", who, refused,
                    done + refused, nice, error)
    return done, refused
