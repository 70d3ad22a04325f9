"""The ingress's CPU split into the parts of a request, measured from outside the process.

Two sources, neither of which costs the ingress anything when no one measures:
- every thread's CPU from /proc/<pid>/task/<tid>/stat (exact, all threads, native ones included),
  grouped by the thread's name;
- py-spy's samples of the threads that run Python (`--nonblocking`, idle threads left out), each
  attributed to the part named by the innermost frame that belongs to one (PARTS, in order).

A part's CPU = the CPU of the threads py-spy saw, shared out by their samples, plus the CPU of
threads py-spy cannot see (Ray's and gRPC's C++ threads) in a part of its own: "native".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

# (part, [(function, file)]): a sample belongs to the part of the innermost frame listed here; a
# frame matches when its function (as py-spy names it: `Class.method`, `outer.<locals>.inner`)
# starts with `function` (or, written "*.name", ends with ".name") and `file` is in its place
# ("path:line)"). Library frames under one of these count in it.
_DELTA_LOOP = [("Gateway.run", f"gateway/stages.py:{line})") for line in range(142, 147)]  # Gateway.run's
PARTS: list[tuple[str, list[tuple[str, str]]]] = [
    ("tokenize", [("RequestFlow.prepare", "flow/request_flow.py"),
                  ("RequestFlow._make_request", "flow/request_flow.py")]),
    ("route", [("RequestFlow._route", "flow/request_flow.py"), ("RouterRef.", "router/actor.py"),
               ("", "router/channel.py")]),  # the route call's task and its answer on the router's channel
    ("prefill call", [("PrefillLeg.", "flow/legs.py")]),
    ("relay", [("DecodeLegs._outputs", "flow/legs.py"), ("coalesce", "flow/relay.py"),
               ("ClientStream.", "flow/stream.py"), ("responses", "api/grpc_api.py"),
               ("delta_to_proto", "api/grpc_api.py"), ("interleave", "api/choices.py"),
               ("relay", "api/grpc_server.py"), ("Handoff.", "api/grpc_server.py"),
               ("Generation.Generate", "api/grpc_server.py"), ("RequestFlow.run", "flow/request_flow.py"),
               ("*.delta", "gateway/"), *_DELTA_LOOP]),
    ("decode call", [("DecodeLegs.", "flow/legs.py"), ("Homes.", "flow/legs.py")]),
    # the ingress's own metrics: queued on the loop, recorded on their thread (Ray's records under it);
    # before this part they were counted in admit, as the rest of gateway/ is
    ("metrics", [("MetricBatch.", "gateway/metric_batch.py")]),
    ("admit", [("Gateway.", "gateway/stages.py"), ("FrontDoor.", "gateway/front_door.py"),
               ("Generation._generate", "api/grpc_server.py"), ("request_from_proto", "api/grpc_api.py"),
               ("", "gateway/")]),
]


# Samples in none of the parts: the library they are in (innermost frame first), or, with only a
# thread's or a loop's entry frames on the stack, that loop's own C code (uvloop/asyncio's selector,
# its wake-ups, C task steps), by thread.
LIBRARIES: list[tuple[str, str]] = [("Ray metrics", "ray/util/metrics"), ("Serve's handles", "ray/serve/"),
                                    ("Ray core", "ray/"), ("gRPC (Python)", "grpc/"), ("asyncio (Python)", "asyncio/")]
RUNNERS = ("Thread.run ", "Thread._bootstrap", "UserCallableWrapper.__init__.<locals>._run_user_code_event_loop",
           "SingletonThreadRouter._get_singleton_asyncio_loop.<locals>._run_router_event_loop", "GrpcServer._run",
           "Worker.main_loop", "<module> ", "_worker (concurrent")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far) of every thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime, stime
    return out


def switches(pid: int) -> int:
    """Context switches so far (voluntary and not) over every thread of `pid`: a wake-up each,
    at the least (/proc/PID/status counts the main thread's only)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        n += sum(int(line.split()[1]) for line in status.splitlines()
                 if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    return n


def cpu_between(before: dict[int, tuple[str, float]],
                after: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}


def spy(pid: int, seconds: float, path: Path, rate: int = 200) -> subprocess.Popen:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", str(rate), "--nonblocking", "--threads", "--format", "raw", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _named(function: str, key: str) -> bool:
    return function.endswith(key[1:]) if key.startswith("*") else function.startswith(key)


def part_of(frames: list[str]) -> str | None:
    for frame in reversed(frames):
        function, _, where = frame.partition(" (")
        for part, keys in PARTS:
            if any(_named(function, f) and file in where for f, file in keys):
                return part
    return None


def read_samples(path: Path) -> dict[int, Counter]:
    """tid -> {part (or 'other: <innermost frame>'): samples} from py-spy's raw output."""
    by_thread: dict[int, Counter] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")  # "thread (TID): NAME", then the frames, outermost first
        if not head.startswith("thread ("):
            continue
        tid_text, _, name = head[len("thread ("):].partition(")")
        tid = int(tid_text, 0)
        frames = rest.split(";") if rest else []
        part = part_of(frames) or f"other: {library_of(frames) or 'loop C code: ' + _family(name.lstrip(': ') or '?')}"
        by_thread[tid][part] += int(count)
    return by_thread


def library_of(frames: list[str]) -> str | None:
    for frame in reversed(frames):
        if frame.startswith(RUNNERS):
            continue
        path = frame.rpartition(" (")[2]
        return next((name for name, key in LIBRARIES if key in path), f"elsewhere: {frame}")
    return None


@dataclass
class Split:
    """CPU seconds by part, and by thread name, over one arm."""

    parts: Counter
    threads: Counter
    others: Counter  # the unattributed samples' innermost frames (seconds)


def split(cpu: dict[int, tuple[str, float]], samples: dict[int, Counter]) -> Split:
    parts, threads, others = Counter(), Counter(), Counter()
    for tid, (name, seconds) in cpu.items():
        threads[_family(name)] += seconds
        seen = samples.get(tid)
        total = sum(seen.values()) if seen else 0
        if not total:
            parts["native (threads without Python)"] += seconds
            continue
        for part, n in seen.items():
            share = seconds * n / total
            if part.startswith("other: "):
                parts["other (libraries, loops)"] += share
                others[part[7:]] += share
            else:
                parts[part] += share
    return Split(parts, threads, others)


THREADS = {"_run_user_code_event_loop": "the front door's loop", "_poll_wrapper": "gRPC's poller thread",
           "_run_router_event_loop": "Serve's router loop", "pdserve-grpc": "the gRPC transport's loop",
           "AsyncIO Thread: default": "Ray's actor loop", "pdserve-tokenize": "the tokenizing threads",
           "?": "unnamed (Ray's C++ threads calling Python)", "MainThread": "Ray's main thread"}


def _family(name: str) -> str:
    """A thread's role: Python's `Thread-N (target)` by its target, a pool's threads together."""
    if name.endswith(")") and " (" in name:
        name = name.rpartition(" (")[2][:-1]
    name = name.rstrip("0123456789_-") or name
    return THREADS.get(name, name)


def save(path: Path, cpu: dict[int, tuple[str, float]], arm: dict) -> None:
    """One arm's per-thread CPU and counts, to split again later (the raw stacks lie beside it)."""
    path.write_text(json.dumps({"cpu": {str(t): list(v) for t, v in cpu.items()},
                                "n": arm["n"], "messages": arm["messages"]}))


def main(argv=None) -> None:
    """Split saved arms again: `python -m cluster.tools.bench.ingress_parts DIR [MAX_TOKENS ...]`."""
    ap = argparse.ArgumentParser(description="Split a front_door --parts run's saved arms into a request's parts.")
    ap.add_argument("dir", type=Path, help="the directory `front_door --parts DIR` wrote")
    ap.add_argument("arms", nargs="*", default=["1", "64"], help="the arms' max_tokens (default: 1 64)")
    args = ap.parse_args(argv)
    d = args.dir
    for arm in args.arms:
        saved = json.loads((d / f"threads-{arm}.json").read_text())
        cpu = {int(t): (v[0], v[1]) for t, v in saved["cpu"].items()}
        s = split(cpu, read_samples(d / f"ingress-{arm}.txt"))
        n = saved["n"]
        print(f"max_tokens {arm}: {saved['messages'] / n:.1f} messages a request, "
              f"{sum(s.parts.values()) / n * 1e3:.3f} ms a request")
        for part, c in s.parts.most_common():
            print(f"  {part:<34} {c / n * 1e3:7.3f}")
        for frame, c in s.others.most_common(12):
            print(f"    other: {frame[:90]:<90} {c / n * 1e3:7.3f}")


if __name__ == "__main__":
    main()
