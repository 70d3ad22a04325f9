"""What a call that releases the GIL costs its thread when other Python threads want the GIL.

    python -m cluster.tools.bench.gil_release [--busy 0 1 2] [--calls 2000]

The front door's loop shares its process with gRPC's transport loop and poller and with Ray's
threads. A call into C that releases the GIL (Ray's metric record, `os.urandom`, a gRPC core
call) lets one of them take it, and the caller waits for it back: up to the interpreter's switch
interval (5 ms) if the other thread runs Python all along. This times such calls alone and beside
`--busy` threads that spin in Python, inside a Ray worker (Ray's metrics need one): the caller's
wall time and its own CPU (`time.thread_time`) a call, and a plain Python call for reference (it
never gives the GIL away). Issue 50, item 5: docs/benchmarks.md, "The front door's GIL".
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid

CALLS = ("Ray Histogram.observe (3 tags)", "Ray Counter.inc (3 tags)", "os.urandom(16)", "uuid.uuid4().hex",
         "a dict lookup (keeps the GIL)")


def measure(busy: int, calls: int) -> dict[str, tuple[float, float]]:
    """name -> (wall µs, the caller's CPU µs) a call, with `busy` spinning threads beside it."""
    from ray.util.metrics import Counter, Histogram  # noqa: PLC0415

    tags = {"tenant": "t", "model": "m", "version": "v"}
    histogram = Histogram(f"gil_release_h{busy}", boundaries=[0.01, 0.1, 1, 10], tag_keys=tuple(tags))
    counter = Counter(f"gil_release_c{busy}", tag_keys=tuple(tags))
    fns = dict(zip(CALLS, (lambda: histogram.observe(0.5, tags), lambda: counter.inc(1, tags),
                           lambda: os.urandom(16), lambda: uuid.uuid4().hex, lambda: tags.get("x"))))
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            for _ in range(1000):
                pass

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    out = {}
    try:
        for name, f in fns.items():
            for _ in range(min(200, calls)):  # warm-up
                f()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                f()
            out[name] = ((time.perf_counter() - wall) / calls * 1e6, (time.thread_time() - cpu) / calls * 1e6)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="spinning Python threads beside the caller")
    ap.add_argument("--calls", type=int, default=2000, help="calls timed per kind and arm")
    args = ap.parse_args(argv)

    import ray  # noqa: PLC0415

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        remote = ray.remote(num_cpus=0)(measure)
        for busy in args.busy:
            result = ray.get(remote.remote(busy, args.calls))
            print(f"{busy} busy thread(s) beside the caller:")
            for name, (wall, cpu) in result.items():
                print(f"  {name:34s} wall {wall:9.1f} µs   the caller's CPU {cpu:7.1f} µs   a call")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
