"""The serving path's terms from the probe's three runs (cluster/tools/bench/serving_probe.py
`serving_terms`): differences of real and engine-alone medians, never negative."""

from __future__ import annotations

from argparse import Namespace

import pytest

from cluster.planner.validation import Metrics
from cluster.tools.bench.serving_probe import serving_terms

ARGS = Namespace(batch=4, output=64, groups=24, prompt=128, gap=2.0)
CPU = {"ingress": 1.0, "router": 0.25, "proxy": 0.25, "decode": 3.0, "decode engine thread on CPU": 2.5}


def runs(l1: tuple, lb: tuple, r1: tuple) -> dict:
    """Each run (real TTFT p50, real TPOT p50, simulated TTFT p50, simulated TPOT p50), seconds."""
    def m(ttft: float, tpot: float) -> Metrics:
        return Metrics(ttft, ttft, tpot, tpot, 1.0)
    return {tag: (m(*run[:2]), m(*run[2:]), CPU, 24 * size)
            for tag, run, size in (("x1", l1, 1), ("xB", lb, 4), ("r1", r1, 1))}


def test_the_terms_are_the_differences_of_the_medians():
    s = serving_terms(runs((0.340, 0.0480, 0.320, 0.0460), (1.0, 0.0700, 0.95, 0.0650), (0.350, 0.0500, 0.320, 0.0470)),
                      ARGS)
    assert s.ttft_local_s == pytest.approx(0.020) and s.ttft_remote_s == pytest.approx(0.030)
    assert s.decode_stream_s == pytest.approx((0.005 - 0.002) / 3)
    assert s.decode_step_s == pytest.approx(0.002 - 0.001)
    assert s.handoff_s == pytest.approx((0.003 - 0.002) * 63)
    assert s.message_cpu_s == pytest.approx(2.0 / (96 * 64))  # ingress + router + proxy + the decode loop's 0.5


def test_a_difference_under_zero_is_held_at_zero_and_kept_as_measured():
    """The session-27 probe's local runs (the batched run read 4 ms under the engine's own curve,
    which as a per-stream slope, -1.64 ms, would price a 16-stream step 24 ms under the engine
    alone), with its remote run's real TTFT lowered to 300 ms so that that difference is negative too."""
    got = runs((0.3325, 0.04602, 0.3173, 0.04507), (0.971, 0.06498, 0.7951, 0.06895), (0.3000, 0.04675, 0.3173, 0.04509))
    s = serving_terms(got, ARGS)
    assert s.decode_stream_s == 0.0
    assert s.decode_step_s == pytest.approx(0.04602 - 0.04507)  # the batch-1 run's difference alone
    assert s.ttft_remote_s == 0.0  # 300.0 real against 317.3 simulated
    assert s.ttft_local_s == pytest.approx(0.3325 - 0.3173)
    assert s.probe["raw"]["per_stream_s"] == pytest.approx(((0.06498 - 0.06895) - (0.04602 - 0.04507)) / 3)
    assert s.probe["raw"]["ttft_remote_s"] == pytest.approx(0.3000 - 0.3173)


def test_a_batch_one_step_under_the_engines_is_floored_and_the_hand_off_is_over_the_priced_step():
    """step_1 -1 ms (real TPOT under the simulated): the decode step's term is 0, not -1 ms, and the
    remote run's first gap counts from that priced 0, not from -1 ms (which would add 63 ms)."""
    s = serving_terms(runs((0.340, 0.0470, 0.320, 0.0480), (1.0, 0.0650, 0.95, 0.0650), (0.350, 0.0490, 0.320, 0.0470)),
                      ARGS)
    assert s.decode_step_s == 0.0 and s.decode_stream_s == pytest.approx(0.001 / 3)
    assert s.handoff_s == pytest.approx((0.002 - 0.001 / 3) * 63)
