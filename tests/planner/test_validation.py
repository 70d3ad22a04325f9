"""The validation's arithmetic (cluster/planner/validation.py) on hand-worked requests; no Ray.

Four requests (arrival, TTFT, end-to-end latency, output tokens), SLO TTFT <= 0.75 s, TPOT <= 0.3 s:
    0: 0 s, 0.5, 2.5, 5 tokens   TPOT (2.5 - 0.5) / 4 = 0.5    misses TPOT
    1: 1 s, 0.25, 1.25, 5        TPOT 0.25                     meets both
    2: 2 s, failed                                             meets nothing
    3: 3 s, 1.0, 3.0, 1 token    no TPOT                       misses TTFT
TTFT sorted [0.25, 0.5, 1.0]: p50 0.5, p90 at rank 1.8: 0.5 + 0.8 x 0.5 = 0.9.
TPOT sorted [0.25, 0.5]: p50 0.375, p90 at rank 0.9: 0.25 + 0.9 x 0.25 = 0.475.
Goodput: 1 request over first arrival (0) -> last completion (3 + 3.0 = 6): 1/6 per second.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.validation import Case, Metrics, Validation, WorkloadRange, ape, band
from cluster.planner.workload import RequestSpec

SLO_ = SLO(ttft_s=0.75, tpot_s=0.3)


def test_metrics_of_hand_worked_requests():
    m = Metrics.of_requests([0.0, 1.0, 2.0, 3.0], [0.5, 0.25, None, 1.0], [2.5, 1.25, None, 3.0], [5, 5, 0, 1], SLO_)
    assert (m.ttft_p50, m.tpot_p50, m.goodput) == (0.5, 0.375, 1 / 6)
    assert m.ttft_p90 == pytest.approx(0.9, abs=1e-15) and m.tpot_p90 == pytest.approx(0.475, abs=1e-15)


def test_metrics_of_a_bench_result_counts_a_failed_request_as_not_completed():
    result = {"start_times": [0.0, 1.0, 2.0, 3.0], "ttfts": [0.5, 0.25, 0.1, 1.0], "latencies": [2.5, 1.25, 0.2, 3.0],
              "output_lens": [5, 5, 0, 1], "statuses": ["ok", "ok", "failed", "ok"]}
    m = Metrics.of_bench(result, SLO_)
    assert (m.ttft_p50, m.tpot_p50, m.goodput) == (0.5, 0.375, 1 / 6)


def test_ape():
    assert ape(2.0, 3.0) == 50.0
    assert ape(4.0, 3.0) == 25.0
    assert ape(0.0, 0.0) == 0.0
    assert ape(0.0, 1.0) == math.inf


def test_band_inverts_the_error():
    assert band(1.5, 50.0) == (1.0, 3.0)  # real 1.0 (sim 50% high) or 3.0 (sim 50% low)
    assert band(1.0, 150.0) == (0.4, math.inf)


def _validation() -> Validation:
    a = Case("0P+1D colocated chunk=512", "chat", SLO_, Metrics(1.0, 2.0, 0.5, 1.0, 4.0), Metrics(1.5, 2.0, 0.25, 1.0, 3.0),
             10, 10, {"client_cpu_cores": 0.25}, {"decode": 8.0})
    b = Case("1P+1D chunk=512 skip<64", "chat", SLO_, Metrics(2.0, 4.0, 0.5, 1.0, 2.0), Metrics(2.0, 3.0, 0.5, 1.5, 2.0),
             10, 10, {}, {})
    return Validation((a, b), (WorkloadRange("chat", 10, 1.0, 256, 128),),
                      {"path": "m", "device": "cpu", "created": "2026-11-27T00:00:00+00:00"}, "now")


def test_mape_per_metric_over_cases():
    v = _validation()
    assert v.cases[0].errors() == {"ttft_p50": 50.0, "ttft_p90": 0.0, "tpot_p50": 50.0, "tpot_p90": 0.0,
                                   "goodput": 25.0}
    assert v.mape() == {"ttft_p50": 25.0, "ttft_p90": 12.5, "tpot_p50": 25.0, "tpot_p90": 25.0, "goodput": 12.5}
    assert v.table()[-1] == ("MAPE over 2 cases: TTFT p50 25.0%, TTFT p90 12.5%, TPOT p50 25.0%, TPOT p90 25.0%, "
                             "goodput 12.5%")


def test_validation_file_round_trip(tmp_path):
    v = _validation()
    v.save(tmp_path / "v.json")
    assert Validation.load(tmp_path / "v.json") == v
    assert json.loads((tmp_path / "v.json").read_text())["mape"]["ttft_p90"] == 12.5


def test_a_case_of_several_runs_is_compared_at_their_median_and_says_their_spread(tmp_path):
    runs = (Metrics(1.0, 2.0, 0.1, 0.2, 1.0), Metrics(1.2, 2.0, 0.1, 0.3, 1.0), Metrics(0.8, 2.6, 0.1, 0.2, 1.0))
    median = Metrics.median(runs)
    assert median == Metrics(1.0, 2.0, 0.1, 0.2, 1.0)
    assert Metrics.median(runs[:2]) == Metrics(1.1, 2.0, 0.1, 0.25, 1.0)
    c = Case("0P+1D chunk=512", "chat", SLO_, median, Metrics(1.1, 2.0, 0.1, 0.2, 1.0), 10, 10, {}, {}, runs)
    # per metric, each run's error against the median, averaged: TTFT p50 (0 + 20 + 20) / 3, p90 (0 + 0 + 30) / 3
    assert c.spread() == pytest.approx({"ttft_p50": 40 / 3, "ttft_p90": 10.0, "tpot_p50": 0.0, "tpot_p90": 50 / 3,
                                        "goodput": 0.0})
    assert c.errors()["ttft_p50"] == pytest.approx(10.0)
    v = Validation((c, replace(c, runs=())), (WorkloadRange("chat", 10, 1.0, 256, 128),), {"path": "m"}, "now")
    assert v.noise() == c.spread()  # only the case with several runs counts
    assert v.table()[-1].startswith("real runs against their median (1 cases with several runs; a floor for the MAPE): "
                                    "TTFT p50 13.3%, TTFT p90 10.0%")
    assert "3 runs: 1000 ms 1200 ms 800 ms" in v.table()[1]
    v.save(tmp_path / "v.json")
    assert Validation.load(tmp_path / "v.json") == v
    assert json.loads((tmp_path / "v.json").read_text())["noise"]["ttft_p90"] == pytest.approx(10.0)
    assert "noise" not in _validation().to_json() and math.isnan(_validation().noise()["ttft_p50"])
    with pytest.raises(ValueError, match="no runs"):
        Metrics.median([])


def test_covers_names_what_lies_beyond_the_validated_traces():
    v = _validation()
    assert v.covers([RequestSpec(0.0, 256, 128), RequestSpec(1.0, 32, 64)]) == []
    assert v.covers([RequestSpec(0.0, 300, 128), RequestSpec(1.0, 32, 200)]) == [
        "prompts up to 300 tokens (validated: up to 256)", "outputs up to 200 tokens (validated: up to 128)"]


def test_workload_range():
    w = WorkloadRange.of("x", [RequestSpec(0.0, 10, 5), RequestSpec(1.0, 30, 2), RequestSpec(4.0, 20, 9)])
    assert w == WorkloadRange("x", 3, 0.5, 30, 9)


def test_cluster_config_parse():
    base = ClusterConfig(0, 1, 512, 64, 1000, 32)
    assert ClusterConfig.parse("1P+2D", base) == ClusterConfig(1, 2, 512, 64, 1000, 32)
    assert ClusterConfig.parse("0P+2D:chunk=256", base) == ClusterConfig(0, 2, 256, 64, 1000, 32)
    assert ClusterConfig.parse("2P+1D:chunk=1024,skip=0") == ClusterConfig(2, 1, 1024, 0)
    for bad in ("1P2D", "1P+1D:size=3", "1P+1D:chunk=x"):
        with pytest.raises(ValueError, match="configuration"):
            ClusterConfig.parse(bad)


def test_merged_validations_pool_their_cases():
    v = _validation()
    long_ = Validation((replace(v.cases[0], workload="long"),), (WorkloadRange("long", 5, 0.25, 1536, 64),),
                       v.profile, "later")
    m = Validation.merged([v, long_])
    assert len(m.cases) == 3 and [w.name for w in m.workloads] == ["chat", "long"] and m.created == "now"
    assert m.mape()["goodput"] == (25.0 + 0.0 + 25.0) / 3
    assert m.mape("long") == v.cases[0].errors() and m.mape("chat") == v.mape()
    assert m.table()[-3:] == [
        "MAPE over 2 chat cases: TTFT p50 25.0%, TTFT p90 12.5%, TPOT p50 25.0%, TPOT p90 25.0%, goodput 12.5%",
        "MAPE over 1 long cases: TTFT p50 50.0%, TTFT p90 0.0%, TPOT p50 50.0%, TPOT p90 0.0%, goodput 25.0%",
        "MAPE over 3 cases: TTFT p50 33.3%, TTFT p90 8.3%, TPOT p50 33.3%, TPOT p90 16.7%, goodput 16.7%"]
    with pytest.raises(ValueError, match="different profiles"):
        Validation.merged([v, Validation((), (), {"path": "other"})])
