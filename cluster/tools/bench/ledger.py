"""Durable ledger calls per second: one caller at a time, each call made durable before the next
(`Ledger.save()` after each, as the actor does for a lone caller; concurrent callers share writes
on top of this). The ledger holds `--open` open reservations over 100 tenants, as a busy month
does; each measured call is a reserve or a settle on one of them.

Before the journal (issue 52) `save()` rewrote the whole file with two fsyncs; after, it appends a
line with one fsync. The same command runs on either checkout:

    PYTHONPATH=<checkout> python cluster/tools/bench/ledger.py [--open 0 1000 10000] [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _arm(directory: Path, open_reservations: int, calls: int) -> float:
    from router.ingress.gateway.budget import Ledger

    ledger = Ledger(directory / "ledger.json")
    for i in range(open_reservations):
        ledger.reserve(f"t{i % 100}", f"open{i}", 1, 10**12)
    ledger.save()
    t0 = time.perf_counter()
    for i in range(calls):
        if i % 2 == 0:
            ledger.reserve("t0", f"r{i}", 10, 10**12)
        else:
            ledger.settle("t0", f"r{i - 1}", 5)
        ledger.save()
    return calls / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--open", type=int, nargs="+", default=[0, 1000, 10000])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dir", default=None, help="where the ledger's files go (default: a temporary directory)")
    args = ap.parse_args()
    rows = []
    for n in args.open:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            rows.append({"open_reservations": n, "calls_per_s": round(_arm(Path(d), n, args.calls), 1)})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
