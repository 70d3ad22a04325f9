"""The plan on a synthetic profile where the answer is worked out by hand (tests/planner/conftest.py):

A 2000-token prompt every 1.5 s, 200 output tokens, transfers free. One prefill step of the whole
prompt takes 1/16 + 2000/1024 = 2.016 s: one prefill replica falls behind (its queue grows by
0.516 s per request), two keep up (each gets a prompt every 3 s), so TTFT = 2.016 s <= 2.5.
A decode step at batch b takes (15 + b) / 1024 s; a dedicated decode replica holds b ~ 2.2
requests (b = 199 / 1.5 x (15 + b) / 1024), so TPOT ~ 0.017 s <= 0.022. A colocated replica that
prefills while another request decodes stalls that request's tokens for a prefill step (>= 2 s over
199 tokens: +0.010 s TPOT), over the SLO; with 3 colocated replicas each request is in flight
~5.1 s against 1.5 s between arrivals, so such collisions happen. Hence: 1 or 2 replicas, or 3
with fewer than 2 prefill replicas, miss the SLO; 2P+1D meets it, in one 2048-token chunk per
prompt (4 chunks of 512 also meet it, with a later TTFT and less goodput); the threshold does not
matter (every prompt is long: the lower wins the tie)."""

from __future__ import annotations

import pytest

from cluster.planner.plan import check_range, configurations, search
from cluster.planner.profile import OutOfRange, Transfer
from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.workload import RequestSpec
from tests.planner.conftest import synthetic_profile

SPECS = [RequestSpec(1.5 * i, 2000, 200) for i in range(40)]
SLO_ = SLO(ttft_s=2.5, tpot_s=0.022)
FREE = Transfer(0.0, float("inf"))


def test_the_plan_picks_the_split_worked_out_by_hand(profile):
    plan = search(profile, SPECS, SLO_, budget=3, chunks=[512, 2048], thresholds=[0, 64],
                  decode_blocks=4096, max_num_seqs=32, attain=0.9, transfer=FREE)
    assert plan.best is not None
    assert plan.best.config == ClusterConfig(2, 1, 2048, 0, 4096, 32)
    assert plan.best.attainment == 1.0
    assert plan.best.ttft.max == 1 / 16 + 2000 / 1024
    assert plan.evaluated == len(configurations(3, [512, 2048], [0, 64], 4096, 32)) == 2 + 2 * 3 + 2 * 5
    # The best 2-replica configuration is colocated (0P+2D), missing TPOT where a prompt's step
    # stalls a running decode (0.0156 + 2.0 / 199 > 0.022). Halving either step time fixes it
    # (0.0078 + 0.0101, or 0.0156 + 0.0050); KV and transfers (free here) do not.
    assert plan.probed.config == ClusterConfig(0, 2, 2048, 0, 4096, 32) and plan.probed.attainment < 0.9
    assert plan.binding == ("decode compute", "prefill compute")
    # the Pareto front rises with replicas and ends at the plan
    assert [r.config.replicas for r in plan.front][-1] == 3
    assert [r.goodput for r in plan.front] == sorted(r.goodput for r in plan.front)


def test_nothing_meets_an_impossible_slo(profile):
    """TTFT 1 s against a 2.016 s prefill step: no configuration meets it, and no single 2x
    relaxation would (half a step is 1.008 s), so nothing is named as binding."""
    plan = search(profile, SPECS[:10], SLO(ttft_s=1.0, tpot_s=0.022), budget=2, chunks=[2048], thresholds=[0],
                  decode_blocks=4096, max_num_seqs=32, transfer=FREE)
    assert plan.best is None
    assert plan.probed.attainment == 0.0 and plan.binding == ()


def test_a_workload_beyond_the_calibration_is_refused(profile):
    with pytest.raises(OutOfRange, match="a 9000-token context > calibrated decode context 8192"):
        check_range(profile, [RequestSpec(0.0, 8000, 1000)], [512], 32)
    with pytest.raises(OutOfRange, match="chunk 8192 tokens > calibrated prefill step of 4096 tokens"):
        check_range(profile, SPECS, [8192], 32)
    with pytest.raises(OutOfRange, match="max_num_seqs 128 > calibrated decode batch 65"):
        search(profile, SPECS, SLO_, budget=1, chunks=[512], thresholds=[0], decode_blocks=4096, max_num_seqs=128)


def test_a_prompt_longer_than_the_calibrated_prefill_context_is_refused():
    with pytest.raises(OutOfRange, match="a 3000-token prompt's chunks start up to 2999 tokens in > calibrated "
                                         "prefill context 2048"):
        check_range(synthetic_profile(max_context=2048), [RequestSpec(0.0, 3000, 1)], [512], 32)


def test_replicas_sharing_cores_are_priced_as_such(profile):
    """`cores`: the same search with every replica on 2 shared cores. The plan above (2P+1D) then
    misses: its two prefill replicas and the decode replica step at once (3 on 2 cores: each step
    1.5x, a 2000-token prompt 3.02 s > 2.5 s TTFT), and no configuration meets the SLO."""
    plan = search(profile, SPECS, SLO_, budget=3, chunks=[512, 2048], thresholds=[0, 64],
                  decode_blocks=4096, max_num_seqs=32, attain=0.9, transfer=FREE, cores=2.0)
    assert plan.best is None
    assert {r.config.cores for r in plan.front} == {2.0}
    alone = search(profile, SPECS, SLO_, budget=3, chunks=[2048], thresholds=[0], decode_blocks=4096,
                   max_num_seqs=32, attain=0.9, transfer=FREE)
    shared = search(profile, SPECS, SLO_, budget=3, chunks=[2048], thresholds=[0], decode_blocks=4096,
                    max_num_seqs=32, attain=0.9, transfer=FREE, cores=2.0)
    assert alone.best.config == ClusterConfig(2, 1, 2048, 0, 4096, 32)
    assert shared.best is None and max(r.attainment for r in shared.front) < alone.best.attainment


def test_a_pick_that_cannot_keep_up_is_never_reported_as_meeting_the_slo(profile):
    """The overloaded replica of test_simulator's trend test (a 2048-token prompt every 1.5 s, a
    2.0625 s prefill step): under a 20 s TTFT every one of its 30 requests meets the SLO, because
    the trace ends before its growing queue reaches 20 s. It is shown, not picked: two replicas."""
    specs = [RequestSpec(1.5 * i, 2048, 1) for i in range(30)]
    plan = search(profile, specs, SLO(20.0, 0.022), budget=2, chunks=[2048], thresholds=[0],
                  decode_blocks=4096, max_num_seqs=32, transfer=FREE)
    one = plan.front[0]
    assert one.config == ClusterConfig(0, 1, 2048, 0, 4096, 32) and one.attainment == 1.0
    assert not one.keeps_up and one.trend.growth_s == 11.25
    assert plan.best.config == ClusterConfig(0, 2, 2048, 0, 4096, 32)
    assert plan.best.keeps_up and plan.best.ttft.max == 2.0625


def test_the_speed_band_is_the_pick_at_five_percent_slower_and_faster_steps(profile):
    """A machine's speed moves between runs; near saturation latency moves far more (planner/plan.py,
    the speed band). The pick 2P+1D: its TTFT (one prefill step, no queue) scales exactly with
    the steps. With a TTFT SLO of 2.05 s it meets the SLO (2.016 s) with no margin for 5% slower
    steps (2.116 s), and the plan says so."""
    from cluster.app.plan_cli import _band_lines
    from cluster.planner.plan import SPEED_BAND

    slo = SLO(ttft_s=2.05, tpot_s=0.022)
    plan = search(profile, SPECS, slo, budget=3, chunks=[2048], thresholds=[0], decode_blocks=4096,
                  max_num_seqs=32, transfer=FREE)
    assert plan.best.config == ClusterConfig(2, 1, 2048, 0, 4096, 32) and plan.best.attainment == 1.0
    slow, fast = plan.band
    step = 1 / 16 + 2000 / 1024
    assert (slow.ttft.max, fast.ttft.max) == (pytest.approx(step * (1 + SPEED_BAND)), pytest.approx(step / (1 + SPEED_BAND)))
    assert (slow.attainment, fast.attainment) == (0.0, 1.0)
    lines = _band_lines(plan, slo)
    assert lines[0].startswith("  at 5% slower / faster steps: attainment 0.0% / 100.0%  TTFT p50 2.116 / 1.920 s")
    assert lines[1] == ("  WARNING: with 5% slower steps the pick misses the SLO (attainment 0.0%): it has no "
                        "margin for a slower machine")
    roomy = search(profile, SPECS, SLO_, budget=3, chunks=[2048], thresholds=[0], decode_blocks=4096,
                   max_num_seqs=32, transfer=FREE)
    assert len(_band_lines(roomy, SLO_)) == 2  # 2.116 s within 2.5: no warning (the band, one run's spread)


def test_no_step_jitter_is_the_deterministic_simulation_and_a_jitter_seed_repeats(profile):
    """The noise is off unless asked for (sigma 0: the profiled times to the bit, whatever its
    seed); with it on, the same stream gives the same run and another stream another."""
    from cluster.planner.simulator import simulate

    config = ClusterConfig(0, 2, 512, 0, 4096, 32)
    plain = simulate(profile, config, SPECS, SLO_, transfer=FREE)
    assert simulate(profile, config, SPECS, SLO_, transfer=FREE, step_jitter=0.0, jitter_seed=7) == plain
    noisy = simulate(profile, config, SPECS, SLO_, transfer=FREE, step_jitter=0.05, jitter_seed=7)
    assert simulate(profile, config, SPECS, SLO_, transfer=FREE, step_jitter=0.05, jitter_seed=7) == noisy
    other = simulate(profile, config, SPECS, SLO_, transfer=FREE, step_jitter=0.05, jitter_seed=8)
    assert noisy.ttft.p50 != plain.ttft.p50 and other.ttft.p50 != noisy.ttft.p50


def test_one_runs_spread_is_the_pick_itself_without_noise_and_the_runs_speeds_with_it(profile):
    """Without noise every draw is the plan's own simulation: the spread is one point. With the
    run's speed alone (no step noise), the pick 2P+1D's TTFT is one prefill step with no queue, so
    draw k's TTFT is the step times draw k's factor exactly, and the spread's ends are the 10th and
    90th percentiles of those factors."""
    import random

    from cluster.planner.outcome import percentile
    from cluster.planner.plan import run_spread
    from cluster.planner.validation import Metrics
    from cluster.planner.simulator import simulate

    config = ClusterConfig(2, 1, 2048, 0, 4096, 32)
    still = run_spread(profile, config, SPECS, SLO_, FREE, draws=5, run_jitter=0.0, step_jitter=0.0)
    assert still.low == still.high == Metrics.of_sim(simulate(profile, config, SPECS, SLO_, transfer=FREE))
    assert still.draws == 5
    speeds = run_spread(profile, config, SPECS, SLO_, FREE, draws=24, run_jitter=0.04, step_jitter=0.0)
    step = 1 / 16 + 2000 / 1024
    factors = sorted(random.Random(k).lognormvariate(0.0, 0.04) for k in range(24))
    assert speeds.low.ttft_p50 == pytest.approx(step * percentile(factors, 10))
    assert speeds.high.ttft_p50 == pytest.approx(step * percentile(factors, 90))
    assert speeds.holds("ttft_p50", step) and not speeds.holds("ttft_p50", step * 1.2)


def test_the_plan_prints_one_runs_spread_and_a_validation_names_the_runs_outside_it(profile):
    from cluster.app.plan_cli import _band_lines
    from cluster.app.plan_runs import side_by_side

    plan = search(profile, SPECS, SLO_, budget=3, chunks=[2048], thresholds=[0], decode_blocks=4096,
                  max_num_seqs=32, transfer=FREE)
    lo, hi = plan.spread.low, plan.spread.high
    assert plan.spread.draws == 24 and lo.ttft_p50 < plan.best.ttft.p50 < hi.ttft_p50
    assert _band_lines(plan, SLO_)[-1] == (
        "  one run's spread (an 80% band: 10th-90th percentile of 24 simulations with noise, the run's speed sigma "
        f"4%, each step's 5%): TTFT p50 {lo.ttft_p50:.3f}-{hi.ttft_p50:.3f} s, p90 {lo.ttft_p90:.3f}-{hi.ttft_p90:.3f} s  "
        f"TPOT p50 {lo.tpot_p50 * 1e3:.1f}-{hi.tpot_p50 * 1e3:.1f} ms, p90 {lo.tpot_p90 * 1e3:.1f}-"
        f"{hi.tpot_p90 * 1e3:.1f} ms")

    from dataclasses import asdict

    from cluster.app.plan_cli import _extra_runs, _plan_json
    doc = _plan_json(plan, profile, SPECS, SLO_, "free", 1.0, 1)
    assert doc["one_run_spread"] == {"draws": 24, "p10": asdict(lo), "p90": asdict(hi)}
    assert _extra_runs(plan) == len(plan.relaxations) + 2 + 24  # the what-ifs, the speed band, the spread

    def inside(name: str) -> float:  # a value inside both the p50's and the p90's bands (every request alike)
        low = max(getattr(lo, f"{name}_p50"), getattr(lo, f"{name}_p90"))
        high = min(getattr(hi, f"{name}_p50"), getattr(hi, f"{name}_p90"))
        assert low < high
        return (low + high) / 2

    def run(ttft_s: float) -> dict:  # a bench result: every request served with this TTFT, TPOT inside the band
        tpot = inside("tpot")
        return {"statuses": ["ok"] * len(SPECS), "start_times": [s.arrival_s for s in SPECS],
                "ttfts": [ttft_s] * len(SPECS), "latencies": [ttft_s + 199 * tpot] * len(SPECS),
                "output_lens": [200] * len(SPECS)}
    ok, slow = run(inside("ttft")), run(hi.ttft_p90 * 1.5)
    lines = side_by_side(plan.best, [ok, slow], SLO_, spread=plan.spread)
    assert lines[2].endswith(f"one run: {lo.ttft_p50 * 1e3:.1f}-{hi.ttft_p50 * 1e3:.1f} ms")
    within = [x for x in lines if "one run's spread" in x]
    assert within[0] == "    within one run's spread"
    assert within[1].startswith(f"    outside one run's spread: TTFT p50 {hi.ttft_p90 * 1.5e3:.1f} ms "
                                f"({lo.ttft_p50 * 1e3:.1f}-{hi.ttft_p50 * 1e3:.1f} ms), TTFT p90")
