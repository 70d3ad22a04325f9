"""`pdserve rollout`: each model's live traffic split and the canary gate's decisions
(router/ingress/versions/rollout.py), read and changed through the app's rollout actor."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    ro = sub.add_parser("rollout", help="each model's live traffic split (changed without a redeploy) and the "
                                        "canary gate's decisions (router/ingress/versions/rollout.py)")
    ros = ro.add_subparsers(dest="rollout_command", required=True)
    rst = ros.add_parser("status", help="splits, each version's outcomes over the gate's window, decisions")
    rst.add_argument("--json", action="store_true")
    rse = ros.add_parser("set", help="set a model's split, e.g. `pdserve rollout set chat v1=90 v2=10`")
    rse.add_argument("model")
    rse.add_argument("weights", nargs="+", metavar="LABEL=WEIGHT", help="versions left out get 0")
    rrb = ros.add_parser("rollback", help="all of a model's traffic to its baseline (its first version)")
    rrb.add_argument("model")
    for c in (rst, rse, rrb):
        c.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    for c in (rse, rrb):
        c.add_argument("--reason", default="manual", help="logged with the decision")
    ro.set_defaults(func=rollout)


def rollout(args) -> int:
    import os  # noqa: PLC0415
    import time  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from router.actor import DEFAULT_APP, lookup  # noqa: PLC0415
    from router.ingress.versions.rollout_actor import rollout_name  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="pdserve",
                 log_to_driver=False)
    actor = lookup(rollout_name(DEFAULT_APP))  # the app `pdserve up` deploys
    if actor is None:
        print("pdserve rollout: no rollout actor in this cluster (no model with several versions is deployed)",
              file=sys.stderr)
        return 1
    try:
        if args.rollout_command == "status":
            status = ray.get(actor.status.remote(), timeout=30)
            if args.json:
                print(json.dumps(status, indent=2))
                return 0
            for name, m in status["models"].items():
                print(f"{name}: " + ", ".join(f"{v}={w:g}" for v, w in m["weights"].items())
                      + f"  (baseline {m['baseline']}; configured " + ", ".join(
                          f"{v}={w:g}" for v, w in m["configured"].items()) + ")")
                for label, w in m["window"].items():
                    print(f"  {label}: {w}")
            for d in status["decisions"][-10:]:
                print(f"{time.strftime('%H:%M:%S', time.localtime(d['time']))} {d['model']} {d['action']}: {d['reason']}")
            return 0
        if args.rollout_command == "set":
            weights = {}
            for item in args.weights:
                label, sep, value = item.partition("=")
                try:
                    weights[label] = float(value)
                except ValueError:
                    sep = ""
                if not sep:
                    print(f"pdserve rollout set: {item!r} is not LABEL=WEIGHT", file=sys.stderr)
                    return 2
            decision = ray.get(actor.set_split.remote(args.model, weights, args.reason), timeout=30)
        else:
            decision = ray.get(actor.rollback.remote(args.model, args.reason), timeout=30)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), ValueError) else e
        print(f"pdserve rollout: {cause}", file=sys.stderr)
        return 2
    print(f"{decision['model']}: {decision['action']} -> " + ", ".join(
        f"{v}={w:g}" for v, w in decision["weights"].items()) + " (every ingress within one evaluate_s)")
    return 0
