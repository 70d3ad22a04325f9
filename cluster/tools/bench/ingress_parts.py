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

import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

# (part, frames): a sample belongs to the part of the innermost frame listed here. A frame is
# "function (file" as py-spy writes it; a match is on the prefix, so a function matches in every
# file that has it unless the file is named. Order matters only between parts sharing a frame.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("tokenize", ("RequestFlow._make_request", "RequestFlow.prepare (", "_make_request (")),
    ("route", ("RequestFlow._route", "_route (request_flow", "hash_request_blocks")),
    ("prefill call", ("PrefillLeg.", "first_token (legs", "_prefill (legs", "release (legs")),
    ("relay", ("DecodeLegs._outputs", "_outputs (legs", "coalesce (relay", "pump (relay", "ClientStream.delta",
               "delta (stream", "responses (grpc_api", "delta_to_proto", "interleave (choices", "relay (grpc_server",
               "deliver (grpc_server", "put (grpc_server", "Generation.Generate", "Generate (grpc_server")),
    ("decode call", ("DecodeLegs.", "stream (legs", "_placed (legs", "_leg (legs")),
    ("admit", ("Gateway.run", "run (stages", "FrontDoor.", "authorize (front_door", "serve (front_door",
               "_start_choices (front_door", "_run (front_door", "request_from_proto", "Generation._generate",
               "_generate (grpc_server", "shedding (front_door", "admit (", "finish (", "charge (")),
]


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


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}


def spy(pid: int, seconds: float, path: Path, rate: int = 200) -> subprocess.Popen:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", str(rate), "--nonblocking", "--threads", "--format", "raw", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def part_of(frames: list[str]) -> str | None:
    for frame in reversed(frames):
        for part, keys in PARTS:
            if any(frame.startswith(k) for k in keys):
                return part
    return None


def read_samples(path: Path) -> dict[int, Counter]:
    """tid -> {part (or 'other: <innermost frame>'): samples} from py-spy's raw output."""
    by_thread: dict[int, Counter] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")
        if not head.startswith("thread ("):
            continue
        tid = int(head[len("thread ("):].split(")")[0], 0)
        frames = rest.split(";")[1:]  # the first is the thread's name
        part = part_of(frames) or f"other: {frames[-1] if frames else '?'}"
        by_thread[tid][part] += int(count)
    return by_thread


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
                parts["other (event loops, Ray, Serve)"] += share
                others[part[7:]] += share
            else:
                parts[part] += share
    return Split(parts, threads, others)


def _family(name: str) -> str:
    """Thread names without their numbers (a pool's threads together)."""
    return name.rstrip("0123456789_-") or name
