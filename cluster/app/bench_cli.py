"""`pdserve bench`: the load generator, whose parser and run live with it (cluster/tools/loadgen/cli.py).
The CLI imports it only here, at start-up, so the tools stay out of every server (tests/test_layers.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from cluster.tools.loadgen.cli import add_bench_parser  # noqa: PLC0415

    add_bench_parser(sub)
