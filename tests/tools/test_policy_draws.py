"""cluster/tools/bench/policy_draws.py: what counts as collapsed, and its summary's figures."""

from cluster.tools.bench.policy_draws import collapsed, summary


def run(arm, hit, p50, p90, seed=0, draw=0):
    return {"arm": arm, "seed": seed, "draw": draw, "hit": hit, "p50": p50, "p90": p90}


def test_a_run_is_collapsed_below_0_6_hit_or_past_300_ms_p50():
    assert [collapsed(run("one", h, p, 0)) for h, p in [(0.6, 300), (0.59, 80), (0.75, 301)]] == [False, True, True]


def test_the_summary_averages_the_runs_that_did_not_collapse_per_arm():
    rows = [run("one", 0.7, 70, 130), run("one", 0.8, 80, 150, draw=100), run("one", 0.3, 1600, 6000, 5, 102),
            run("cells", 0.24, 3095, 7866, 5, 5)]
    assert summary(rows) == ["collapsed: [(5, 102, 'one'), (5, 5, 'cells')]",
                             "one router: 2 of 3 runs not collapsed: hit 0.750 p50 75.000 p90 140.000",
                             "cells of 32: 0 of 1 runs not collapsed: "]
