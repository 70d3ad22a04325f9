"""The `pdserve` command line: one module per subcommand (cluster/app/*_cli.py), assembled here."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.app import (audit_cli, bench_cli, budget_cli, generate_cli, init_model_cli, models_cli, plan_cli,
                         rollout_cli, slo_rules_cli, up_cli)


def _status(args) -> int:
    from cluster.app.status_cli import status  # noqa: PLC0415

    return status(args)


def _add_status_parser(sub) -> None:
    st = sub.add_parser("status", help="replicas, KV usage and queues of a running pdserve")
    st.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)


# In the order `pdserve --help` lists them.
SUBCOMMANDS = (init_model_cli.add_parser, generate_cli.add_parser, up_cli.add_parser, _add_status_parser,
               audit_cli.add_parser, budget_cli.add_parser, slo_rules_cli.add_parser, models_cli.add_parser,
               rollout_cli.add_parser, plan_cli.add_planner_parsers, bench_cli.add_parser)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
