"""The local cluster's processes, found by the titles Ray gives them, and the CPU they have used:
what the benchmarks charge to each part of the serving path."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def serve_pids() -> dict[str, int]:
    """The app's processes: every Serve replica (`ingress[pid]`, `decode[pid]`, ...), the proxy, the
    router, the audit writer. A title carries the method running at that moment
    (`ServeReplica:pdserve:prefill.handle_request`): only the deployment's name is kept."""
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        if "ServeReplica:pdserve:" in title:
            name = title.split("ServeReplica:pdserve:", 1)[1].split()[0].split(".")[0]
            found[f"{name}[{p.info['pid']}]"] = p.info["pid"]
        elif "ray::ProxyActor" in title:
            found["proxy"] = p.info["pid"]
        elif "ray::RouterActor" in title:
            found["router"] = p.info["pid"]
        elif "ray::AuditWriter" in title:
            found["audit writer"] = p.info["pid"]
    return found


def cpu_seconds(pids: dict[str, int], ingress_threads: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far; with ingress_threads, each
    thread of an ingress apart too (keys `  ingress[pid] thread <name>`)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            t = proc.cpu_times()
            out[name] = t.user + t.system
            if ingress_threads and name.startswith("ingress"):
                for th in proc.threads():
                    with contextlib.suppress(OSError):
                        comm = Path(f"/proc/{pid}/task/{th.id}/comm").read_text().strip()
                        key = f"  {name} thread {comm}"
                        out[key] = out.get(key, 0.0) + th.user_time + th.system_time
    return out


def run_delays(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Per process, each thread's (seconds on a CPU, seconds runnable but waiting for one) so far,
    from the kernel's scheduler statistics (/proc/PID/task/TID/schedstat). Keys `name/tid`."""
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    on_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                    out[f"{name}/{tid}"] = (int(on_ns) / 1e9, int(wait_ns) / 1e9)
    return out


def busiest_threads_wait(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                         prefixes: tuple[str, ...] = ("prefill", "decode")) -> dict[str, tuple[float, float]]:
    """Per process named with one of `prefixes`, its busiest thread over the interval (an engine
    replica's: the engine's step thread) as (seconds on a CPU, seconds waiting for one)."""
    best: dict[str, tuple[float, float]] = {}
    for key, (on, wait) in after.items():
        name = key.rsplit("/", 1)[0]
        if not name.startswith(prefixes):
            continue
        on0, wait0 = before.get(key, (0.0, 0.0))
        if on - on0 > best.get(name, (-1.0, 0.0))[0]:
            best[name] = (on - on0, wait - wait0)
    return best
