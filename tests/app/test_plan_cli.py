"""`pdserve plan` end to end on the synthetic profile of tests/planner (no Ray, no torch)."""

from __future__ import annotations

import json
from dataclasses import replace

import yaml

from cluster.app.cli import main
from cluster.config.app import AppConfig
from cluster.planner.config import SLO
from cluster.planner.profile import Curve
from cluster.planner.validation import Case, Metrics, Validation, WorkloadRange
from cluster.planner.profile import Serving
from tests.planner.conftest import synthetic_profile as engine_only_profile


def synthetic_profile(**kw):
    """The synthetic profile, calibrated for a plan: a serving path that costs nothing (its device
    kind is none: no cores to share; its transfer is given)."""
    return replace(engine_only_profile(**kw), serving=Serving(0.0, 0.0, 0.0, 0.0, 0.0))

TRACE = "".join(json.dumps({"timestamp": 1500 * i, "input_length": 2000, "output_length": 200}) + "\n"
                for i in range(40))


def test_plan_prints_the_hand_worked_plan_and_emits_its_config(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    (tmp_path / "t.jsonl").write_text(TRACE)
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.jsonl"),
               "--slo", "ttft=2.5,tpot=22ms", "--budget", "3", "--chunks", "512,2048", "--skip-prefill", "0",
               "--max-num-seqs", "32", "--transfer-gbps", "1000", "--emit-config", str(tmp_path / "plan.yaml")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "plan:\n  2P+1D chunk=2048 skip<0 " in out
    assert "binding constraint (one replica fewer: 0P+2D colocated chunk=2048, attainment" in out
    assert "validation: NONE given (--validation FILE;" in out
    cfg = AppConfig.model_validate(yaml.safe_load((tmp_path / "plan.yaml").read_text()))
    assert (cfg.mode, cfg.prefill.num_replicas, cfg.decode.num_replicas) == ("disaggregated", 2, 1)
    assert (cfg.engine.max_num_batched_tokens, cfg.engine.max_num_seqs, cfg.routing.local_prefill_threshold) == (
        2048, 32, 0)
    # the SLO it was planned for: admission derives its bounds from it exactly (issue 51: without it,
    # the defaults' 1 s / 100 ms refused 56 of 90 requests of a trace planned for 3 s / 200 ms)
    assert (cfg.admission.ttft_objective_s, cfg.admission.itl_objective_s) == (2.5, 0.022)
    assert (cfg.telemetry.slo.ttft_threshold_s, cfg.telemetry.slo.itl_threshold_s) == (2.5, 0.04)  # buckets at or above
    bounds = cfg.admission_bounds
    assert (bounds.max_queue_wait_s, round(bounds.target_itl_s, 6)) == (1.25, 0.0176)


def test_plan_refuses_a_trace_beyond_the_calibration(tmp_path, capsys):
    synthetic_profile(max_context=1024).save(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=1,n=5,prompt=900,output=200",
               "--slo", "ttft=1,tpot=0.1", "--budget", "2", "--max-num-seqs", "8"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "refused: the workload is outside the profile's calibrated range: a 1100-token context > " \
           "calibrated decode context 1024" in err


def test_plan_json_says_it_is_not_validated_without_a_validation_file(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=2,n=20,prompt=100:200,output=8",
               "--slo", "ttft=1,tpot=0.1", "--budget", "2", "--max-num-seqs", "8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["validated"] is False and doc["validation"] is None
    assert doc["best"]["config"]["decode_replicas"] >= 1
    assert doc["transfer"] == "measured"  # the synthetic profile carries a transfer line


def test_plan_notes_lookups_below_the_grid(tmp_path, capsys):
    p = synthetic_profile()
    d = p.decode
    replace(p, decode=Curve("decode", "batch", "context", d.xs, [128, 8192], d.values)).save(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=1,n=3,prompt=16,output=4",
               "--slo", "ttft=1,tpot=0.1", "--budget", "1", "--chunks", "256", "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    # 1 replica, 3 requests of 16 + 4 tokens: each decode step's context (17-19) is below 128
    assert "note: 9 step times were read below the profile's first grid point" in out


def _validation_file(path, created: str = "") -> str:
    """One case whose errors are TTFT p50 50%, p90 0%, TPOT p50 50%, p90 0%, goodput 25%, validated
    on prompts up to 150 tokens, simulated with the synthetic profile (path "synthetic", created "")."""
    case = Case("0P+1D colocated chunk=512", "chat", SLO(1.0, 0.1), Metrics(1.0, 2.0, 0.5, 1.0, 4.0),
                Metrics(1.5, 2.0, 0.25, 1.0, 3.0), 10, 10, {}, {})
    Validation((case,), (WorkloadRange("chat", 10, 1.0, 150, 64),),
               {"path": "synthetic", "device": "cpu", "created": created}).save(path)
    return str(path)


def test_plan_reports_the_validation_mape_and_widens_its_figures_by_it(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=2,n=20,prompt=100:150,output=8",
            "--slo", "ttft=1,tpot=0.1", "--budget", "2", "--max-num-seqs", "8",
            "--validation", _validation_file(tmp_path / "v.json")]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    mape = {"ttft_p50": 50.0, "ttft_p90": 0.0, "tpot_p50": 50.0, "tpot_p90": 0.0, "goodput": 25.0}
    assert doc["validated"] is True
    assert doc["validation"]["mape"] == mape and doc["validation"]["same_profile"] is True
    assert doc["validation"]["outside"] == []
    best = doc["best"]
    sim = {"ttft_p50": best["ttft"]["p50"], "ttft_p90": best["ttft"]["p90"], "tpot_p50": best["tpot"]["p50"],
           "tpot_p90": best["tpot"]["p90"], "goodput": best["goodput"]}
    assert doc["validation"]["bands"] == {m: [v, v / (1 + mape[m] / 100), v / (1 - mape[m] / 100)]
                                          for m, v in sim.items()}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("validation: 1 real runs (0P+1D on chat) on cpu: MAPE TTFT p50 50%, TTFT p90 0%, TPOT p50 50%, "
            "TPOT p90 0%, goodput 25%\n  the plan's figures, widened by the MAPE") in out
    assert "note:" not in out.split("validation:")[1]


def test_plan_says_when_the_validation_does_not_cover_its_workload_or_profile(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=2,n=20,prompt=200,output=80",
               "--slo", "ttft=1,tpot=0.1", "--budget", "2", "--max-num-seqs", "8",
               "--validation", _validation_file(tmp_path / "v.json", created="2026-01-01T00:00:00+00:00")])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("  note: the validation was simulated with another profile (created 2026-01-01T00:00:00+00:00, "
            "this one ): its errors may not carry over") in out
    assert ("  note: this workload lies outside what was validated (prompts up to 200 tokens (validated: up to 150); "
            "outputs up to 80 tokens (validated: up to 64)): the error figures do not cover it") in out


def test_plan_refuses_an_engine_only_profile_unless_told_and_then_says_so_first(tmp_path, capsys):
    """Issue 54: an engine-only profile's plan missed a real run by 61-86%. Refused, naming what
    it lacks; with --uncalibrated, its first line says so and the figures are widened."""
    engine_only_profile().save(tmp_path / "p.json")
    (tmp_path / "t.jsonl").write_text(TRACE)
    argv = ["plan", "--profile", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.jsonl"),
            "--slo", "ttft=2.5,tpot=22ms", "--budget", "3", "--chunks", "2048", "--skip-prefill", "0",
            "--max-num-seqs", "32", "--transfer-gbps", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"pdserve plan: refused: {tmp_path / 'p.json'} is not calibrated for a plan: it lacks the serving "
                   "path's cost (per request, step, stream and relayed token). Run `pdserve profile` without "
                   "--engine-only on the machine that will serve (or give --uncalibrated to plan anyway, with "
                   "widened figures)\n")
    assert main(argv + ["--uncalibrated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("UNCALIBRATED: the profile lacks the serving path's cost")
    assert lines[5] == "plan:" and lines[6].startswith("  2P+1D chunk=2048 skip<0 ")
    # TTFT p50 2.015625 s widened by 61%: / 1.61 = 1252 ms to / 0.39 = 5168 ms
    [widened] = [x for x in lines if x.startswith("UNCALIBRATED: the plan's figures widened")]
    assert "TTFT p50 2016 (1252-5168) ms" in widened
    assert "  WARNING: the upper end of a p90 band is past the SLO: calibrate before trusting the pick" in lines


def test_plan_validate_runs_are_bounded(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", "rate=2,n=20,prompt=100:200,output=8",
               "--slo", "ttft=1,tpot=0.1", "--budget", "1", "--max-num-seqs", "8", "--validate", "11"])
    assert rc == 2 and capsys.readouterr().err == "pdserve plan: --validate: at most 10 runs, got 11\n"
