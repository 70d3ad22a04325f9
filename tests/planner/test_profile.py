"""The profile's curves: exact at measured points, linear between them, no extrapolation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.planner.profile import Serving, Curve, OutOfRange, Profile
from tests.planner.conftest import synthetic_profile


def curve() -> Curve:
    return Curve("decode", "batch", "context", [1, 3], [0, 100, 200], [[1.0, 2.0, 4.0], [3.0, 4.0, 6.0]])


def test_a_curve_is_exact_at_its_points_and_bilinear_between():
    c = curve()
    assert c(1, 0) == 1.0 and c(3, 200) == 6.0 and c(1, 100) == 2.0
    assert c(2, 0) == 2.0  # halfway along batch
    assert c(1, 150) == 3.0  # halfway along context, second cell
    assert c(2, 150) == 4.0  # the middle of a cell: the mean of its corners (2, 4, 4, 6)


def test_a_curve_refuses_to_extrapolate_and_counts_clamps_below():
    c = curve()
    with pytest.raises(OutOfRange, match=r"decode: context=201 is beyond the calibrated range \[0, 200\]"):
        c(1, 201)
    with pytest.raises(OutOfRange, match="batch=4"):
        c(4, 0)
    assert c(0.5, 0) == 1.0 and c.clamped_low == 1  # below the first point: the first point (an over-estimate)


def test_a_curve_checks_its_grid():
    with pytest.raises(ValueError, match="strictly ascending"):
        Curve("x", "a", "b", [1, 1], [0], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="must be 2 x 1"):
        Curve("x", "a", "b", [1, 2], [0], [[1.0]])


def test_a_profile_round_trips_through_json(tmp_path):
    p = synthetic_profile()
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p
    assert q.kv_bytes_per_token == 1024 and q.block_size == 16
    assert q.scaled(prefill=0.5).prefill(0, 0) == p.prefill(0, 0) / 2
    served = replace(p, serving=Serving(0.01, 0.02, -0.0005, 0.00025, 0.07, {"runs": ["probe-0P1D-x1"]}))
    served.save(tmp_path / "s.json")
    assert Profile.load(tmp_path / "s.json") == served


def test_a_file_of_another_format_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a pdserve-profile/1 file"):
        Profile.load(tmp_path / "x.json")


def test_a_mixed_step_is_one_forward_of_its_rows_plus_the_decodes_attention():
    """Issue 54: a step of B decodes and a prompt chunk is one forward over chunk + B rows (the
    engine's model_runner batches them), plus the decodes' attention over their own KV beyond the
    decode curve's smallest context. On curves bilinear in their axes (so interpolation is exact):
        prefill(t, c) = 1/16 + t/1024 + t c / 2**20
        decode(b, L)  = 1/64 + (b - 1)/1024 + b (L - 128) / 2**18
    a step of a 200-token chunk after 256 and 4 decodes at 640 is prefill(204, 256) + 4 x 512 / 2**18,
    not prefill(200, 256) + decode(4, 640), which counts the step's 1/64 s and its rows twice."""
    def pf(t, c):
        return 1 / 16 + t / 1024 + t * c / 2**20

    def dc(b, ctx):
        return 1 / 64 + (b - 1) / 1024 + b * (ctx - 128) / 2**18

    prof = replace(synthetic_profile(),
                   prefill=Curve("prefill", "tokens", "cached", [0, 1024], [0, 1024],
                                 [[pf(t, c) for c in (0, 1024)] for t in (0, 1024)]),
                   decode=Curve("decode", "batch", "context", [1, 65], [128, 1152],
                                [[dc(b, x) for x in (128, 1152)] for b in (1, 65)]))
    mixed = prof.mixed_step(200, 256, 4, 640)
    assert mixed == pytest.approx(pf(204, 256) + 4 * 512 / 2**18, abs=1e-12)
    # the sum's excess: the step's 1/64 s and the rows' 3/1024 again, less the 4 rows as prompt tokens
    excess = 1 / 64 + 3 / 1024 - 4 / 1024 - 4 * 256 / 2**20
    assert prof.prefill(200, 256) + prof.decode(4, 640) - mixed == pytest.approx(excess, abs=1e-12)
    assert prof.mixed_step(200, 256, 4, 100) == pytest.approx(pf(204, 256), abs=1e-12)  # below 128: no attention term
    assert prof.decode.clamped_low == 0
