"""`pdserve plan --validate 1` on the tiny model (Ray: `pdserve up` joins the session's Ray): the
plan's pick is served, the plan's trace replayed once, and predicted against measured printed side
by side. The figures are this machine's; what is asserted is what was run and printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.planner.profile import Serving
from tests.planner.conftest import synthetic_profile

PDSERVE = str(Path(sys.executable).parent / "pdserve")


def test_validate_runs_the_pick_for_real_and_prints_predicted_against_measured(ray_session, tiny_model, tmp_path):
    prof = synthetic_profile()
    prof = replace(prof, model={"path": tiny_model}, engine={**prof.engine, "kv_block_bytes": 2 * 2 * 2 * 16 * 4 * 16},
                   serving=Serving(0.0, 0.0, 0.0, 0.0, 0.0))
    prof.save(tmp_path / "p.json")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"timestamp": 200 * i, "input_length": 20 + i,
                                                          "output_length": 4}) + "\n" for i in range(5)))
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    done = subprocess.run([PDSERVE, "plan", "--profile", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.jsonl"),
                           "--slo", "ttft=5,tpot=1", "--budget", "1", "--chunks", "64", "--max-num-seqs", "8",
                           "--kv-gb", "0.005", "--validate", "1", "--validate-dir", str(tmp_path / "v")],
                          capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert "plan:" in out and out[out.index("plan:") + 1].startswith("  0P+1D colocated chunk=64 ")
    start = out.index("validate: predicted against measured (1 run(s); measured = the median over runs)")
    rows = [re.fullmatch(r"  (TTFT p50|TTFT p90|TPOT p50|TPOT p90|goodput) +([0-9.]+) (ms|req/s) *([0-9.]+) "
                         r"(ms|req/s) +([0-9.]+|inf)%(   one run: [0-9.]+-[0-9.]+ ms)?", line)
            for line in out[start + 2:start + 7]]
    assert [m[1] for m in rows] == ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "goodput"], out[start:]
    assert all(float(m[4]) > 0 for m in rows), out[start:]  # measured
    assert out[start + 7].startswith("  run 1: 5/5 served; load generator kept its schedule"), out[start + 7]
    assert [m[7] is not None for m in rows] == [True] * 4 + [False]  # one run's spread beside each latency
    assert out[start + 8].startswith(("    within one run's spread", "    outside one run's spread: ")), out[start + 8]
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["run0.json", "server.log", "trace.jsonl",
                                                                  "validate.yaml"]
    assert json.loads((tmp_path / "v" / "run0.json").read_text())["statuses"] == ["ok"] * 5


def test_a_run_names_the_codes_its_unserved_requests_ended_with():
    from cluster.app.plan_runs import unserved

    run = {"statuses": ["ok", "failed", "failed", "ok", "failed", "incomplete"],
           "error_codes": [None, "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", None, "UNAVAILABLE", None],
           "errors": [None, "pace: 4 streams at 250 ms a token", "second", None, "no replica", None]}
    assert unserved(run) == [("RESOURCE_EXHAUSTED", 2, "pace: 4 streams at 250 ms a token"),
                             ("UNAVAILABLE", 1, "no replica")]
    assert unserved({"statuses": ["ok"], "error_codes": [None], "errors": [None]}) == []


def test_a_run_that_refused_some_is_also_compared_with_the_simulator_on_what_it_served():
    """Issue 54: a refused request is left out of the run's figures, while the simulator serves it
    and its prompt delays the others. The side-by-side adds, for such a run, the simulator again on
    the requests the run served. Synthetic profile, one colocated replica: of 0.0 / 0.1 / 10.0 s
    arrivals (32-token prompts, 3 tokens), the run served the first and the third, each as the
    simulator alone does: TTFT prefill_s(32) = 3/32 s, TPOT decode_s(1) = 1/64 s, error 0.0%."""
    from cluster.app.plan_runs import run_speed, served_specs, side_by_side
    from cluster.planner.config import SLO, ClusterConfig
    from cluster.planner.plan import at_speed
    from cluster.planner.simulator import simulate
    from cluster.planner.workload import RequestSpec
    from tests.planner.conftest import decode_s, prefill_s

    prof, slo, cfg = synthetic_profile(), SLO(5.0, 1.0), ClusterConfig(0, 1, chunk_tokens=512)
    specs = [RequestSpec(0.0, 32, 3), RequestSpec(0.1, 32, 3), RequestSpec(10.0, 32, 3)]
    ttft, e2e = prefill_s(32), prefill_s(32) + 2 * decode_s(1)
    run = {"statuses": ["ok", "failed", "ok"], "error_codes": [None, "RESOURCE_EXHAUSTED", None],
           "errors": [None, "pace", None], "start_times": [0.0, 0.1, 10.0], "ttfts": [ttft, None, ttft],
           "latencies": [e2e, None, e2e], "output_lens": [3, 0, 3], "input_lens": [32, 32, 32]}
    assert served_specs(run, specs) == [specs[0], specs[2]]
    assert served_specs({**run, "input_lens": [32, 32, 31]}, specs) == []  # not this trace's run
    lines = side_by_side(simulate(prof, cfg, specs, slo), [run], slo, specs,
                         lambda served, factor: at_speed(prof, factor, cfg, served, slo))
    assert lines[-3:] == ["    RESOURCE_EXHAUSTED x1: pace",
                          "    the simulator on the 2 requests it served: TTFT p50 93.8 ms (0.0%), "
                          "TTFT p90 93.8 ms (0.0%), TPOT p50 15.6 ms (0.0%), TPOT p90 15.6 ms (0.0%)",
                          "    at the speed its TTFT p50 reads (every step x1.00 the profile's): the simulator's "
                          "TPOT p50 15.6 ms (0.0%), p90 15.6 ms (0.0%), TTFT p90 94 ms (0.0%)"]
    # a run whose prompts took 10% longer reads as 10% slower steps
    slow = {**run, "ttfts": [1.1 * ttft, None, 1.1 * ttft]}
    assert run_speed(lambda served, factor: at_speed(prof, factor, cfg, served, slo), [specs[0], specs[2]],
                     1.1 * ttft) == pytest.approx(1.1, abs=1e-3)
    assert "every step x1.10 the profile's" in side_by_side(
        simulate(prof, cfg, specs, slo), [slow], slo, specs, lambda served, f: at_speed(prof, f, cfg, served, slo))[-1]
    assert all("the simulator on" not in line for line in side_by_side(simulate(prof, cfg, specs, slo), [run], slo))


def test_each_replay_draws_prompts_of_its_own_so_none_hits_the_last_ones_cache(tmp_path):
    """Three replays of a chat trace on one server measured TTFT p50 63 ms against 362 predicted:
    the second and third replayed the first's prompts, whose 10k tokens the pool still held. Each
    replay's bench command (parsed and its dataset drawn by the bench's own code) now draws
    prompts that share no token block with another replay's."""
    import argparse

    from cluster.app.plan_runs import bench_command, write_trace
    from cluster.planner.config import SLO
    from cluster.planner.workload import RequestSpec
    from cluster.tools.loadgen.cli import add_bench_parser, make_dataset, seeded_generators

    write_trace(tmp_path / "t.jsonl", [RequestSpec(0.5 * i, 48 + i, 8) for i in range(6)])
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    prompts = []
    for seed in range(3):
        cmd = bench_command(9000, tmp_path / "t.jsonl", SLO(1.0, 0.1), tmp_path / f"run{seed}.json", 6, seed)
        args = parser.parse_args(cmd[1:])
        dataset = make_dataset(args, 49152, None, 2048)
        sessions = dataset.sample(6, seeded_generators(args.seed)[0])
        assert [len(s.turns[0].prompt.token_ids) for s in sessions] == [48 + i for i in range(6)]
        prompts.append({s.turns[0].prompt.token_ids[:16] for s in sessions})
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
