"""`pdserve budget`: each tenant's spend this month (router/ingress/gateway/budget.py)."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    bu = sub.add_parser("budget", help="each tenant's spend this month (the ledger actor, or --file)")
    bu.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    bu.add_argument("--file", help="read the ledger's file (budgets.ledger_path) instead of the running cluster")
    bu.add_argument("--json", action="store_true")
    bu.set_defaults(func=budget)


def budget(args) -> int:
    """Each tenant's spend this month: from the running cluster's ledger actor, or its file."""
    if args.file:
        from router.ingress.gateway.budget import Ledger  # noqa: PLC0415

        snap = Ledger(args.file).snapshot()
    else:
        import os  # noqa: PLC0415

        import ray  # noqa: PLC0415

        from router.actor import DEFAULT_APP, lookup, scoped_name  # noqa: PLC0415
        from router.ingress.gateway.budget_actor import LEDGER  # noqa: PLC0415

        if not ray.is_initialized():
            ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="pdserve",
                     log_to_driver=False)
        ledger = lookup(scoped_name(DEFAULT_APP, LEDGER))  # the app `pdserve up` deploys
        if ledger is not None:
            snap = ray.get(ledger.snapshot.remote(), timeout=30)
        else:
            print("pdserve budget: no ledger in this cluster (no prices or budgets configured, or no request yet)",
                  file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(snap))
        return 0
    print(f"month {snap['month']} (UTC)")
    print(f"{'tenant':<20} {'spent $':>14} {'in flight $':>14} {'budget $':>12} {'used':>7}")
    for tenant, s in snap["tenants"].items():
        budget = s["budget_usd"]
        used = "" if not budget else f"{(s['spent_usd'] + s['reserved_usd']) / budget:.1%}"
        print(f"{tenant:<20} {s['spent_usd']:>14.6f} {s['reserved_usd']:>14.6f} "
              f"{'-' if budget is None else f'{budget:.2f}':>12} {used:>7}")
    return 0
