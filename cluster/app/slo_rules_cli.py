"""`pdserve slo-rules`: Prometheus recording and alerting rules for the config's SLOs
(cluster/telemetry/slo.py)."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    sr = sub.add_parser("slo-rules", help="print Prometheus recording and alerting rules for the config's SLOs "
                                          "(telemetry.slo; the defaults are deploy/prometheus/pdserve-rules.yml)")
    sr.add_argument("--config", help="app config YAML (default: the built-in defaults)")
    sr.add_argument("--time-scale", type=float, default=1.0,
                    help="shrink every window and `for` by this factor (tests and drills; names stay nominal)")
    sr.set_defaults(func=slo_rules)


def slo_rules(args) -> int:
    from cluster.config import AppConfig  # noqa: PLC0415
    from cluster.telemetry.slo import render  # noqa: PLC0415

    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    sys.stdout.write(render(cfg.telemetry.slo, args.time_scale, cfg.budgets.alert_fraction))
    return 0
