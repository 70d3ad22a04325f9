"""`pdserve profile`'s measurements on the tiny model: the grid it promises, checked points (the
timings themselves are this machine's, not asserted)."""

from __future__ import annotations

import re

import pytest

from cluster.planner.calibrate import calibrate
from cluster.planner.profile import OutOfRange, Profile


def test_a_small_grid_gives_a_profile_with_its_range(tiny_model, tmp_path):
    lines, expected = [], []
    prof = calibrate(tiny_model, prefill_tokens=[16, 48], prefill_cached=[0, 32], decode_batch=[1, 3],
                     decode_context=[32, 64], reps=1, device="cpu", log=lines.append, threads=1,
                     announce=expected.append)
    assert prof.prefill.xs == (16, 48) and prof.prefill.ys == (0, 32)
    assert prof.decode.xs == (1, 3) and prof.decode.ys == (32, 64)
    assert all(v > 0 for row in prof.prefill.values + prof.decode.values for v in row)
    assert prof.transfer is None and any("transfer not measured" in n for n in prof.notes)
    assert any("decode points: distinct prompts, admitted as imported" in n for n in prof.notes)
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv_heads x head_dim x fp32
    assert prof.versions["pdserve"] and prof.device["kind"] == "cpu" and prof.device["threads"] == 1
    # progress: the grid's expected duration announced once, before the first point; then a line a
    # point, in the grid's order, each with the time spent and left
    assert len(expected) == 1 and expected[0] > 0
    points = [re.fullmatch(r"\[(\d+)/8\] (.*): [0-9.]+ ms  \(\d+ s, ~\d+ s left\)", line) for line in lines
              if not re.fullmatch(r"(prefill|decode) \(\d+, \d+\): .* was above a larger point's; again .* ms", line)]
    assert [int(m[1]) for m in points] == list(range(1, 9)), lines
    assert [m[2] for m in points] == [f"prefill {n} tokens after {c} cached" for n in (16, 48) for c in (0, 32)] + [
        f"decode batch {b} at context {ctx}" for b in (1, 3) for ctx in (32, 64)]
    prof.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    with pytest.raises(OutOfRange, match="prefill: tokens=49"):
        loaded.prefill(49, 0)


def test_a_decode_point_admits_distinct_prompts_as_imported_and_computes_no_prompt(tiny_model):
    from cluster.planner.calibrate import Calibrator, engine_for

    engine = engine_for(tiny_model, [16], [0], [1, 3], [32, 64], device="cpu")
    cal = Calibrator(engine, reps=2, log=lambda _: None)
    prompts = []
    make = engine.make_request
    engine.make_request = lambda rid, prompt_token_ids, sampling: prompts.append(prompt_token_ids) or make(
        rid, prompt_token_ids=prompt_token_ids, sampling=sampling)
    before = engine.stats.tokens_computed
    cal.decode(3, 64)
    assert [len(p) for p in prompts] == [64] * 3 and len({tuple(p[:16]) for p in prompts}) == 3
    # warm-up and two timed steps of three one-token decodes; not one prompt token computed
    assert engine.stats.tokens_computed - before == 3 * 3
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks  # all given back


def test_context_points_must_be_whole_blocks(tiny_model):
    with pytest.raises(ValueError, match="multiples of the block size"):
        calibrate(tiny_model, prefill_cached=[0, 20], reps=1, device="cpu", log=lambda _: None)


def test_sharing_times_engine_processes_stepping_at_once_against_one_alone(tiny_model):
    """Spawned engine processes (1, then 2 at once), each stepping for half a second: one factor per
    count, the first exactly 1 (a step alone against itself). The factors are this machine's."""
    from cluster.planner.calibrate import measure_sharing

    lines = []
    factors = measure_sharing(tiny_model, 2, seconds=0.5, log=lines.append)
    assert len(factors) == 2 and factors[0] == 1.0
    assert [line.split(":")[1].strip() for line in lines] == ["1 engine processes at once", "2 engine processes at once"]
    # the factor returned is the one logged, and the geometric mean of the two slow-downs logged
    # beside it (each printed to 2 places: off by at most 0.005)
    prefill_x, decode_x, factor_x = (float(x) for x in re.findall(r"([0-9.]+)x", lines[1]))
    assert re.fullmatch(r".* ms \(1\.00x\), decode 4 x 256 .* ms \(1\.00x\): 1\.00x", lines[0]), lines[0]
    assert factor_x == round(factors[1], 2)
    assert abs(prefill_x * decode_x - factors[1] ** 2) <= 0.005 * (prefill_x + decode_x) + 0.005 ** 2


def test_the_sharing_factor_is_the_geometric_mean_of_the_median_slow_downs():
    from cluster.planner.calibrate import sharing_factor

    # seconds in binary fractions: the medians are exact
    alone = sharing_factor([([0.5, 0.75, 0.625], [0.125, 0.25, 0.125])], None)
    assert alone == (0.625, 0.125, 1.0)
    # two processes at once: medians over both, 1.25 s (2x) and 0.28125 s (2.25x) -> sqrt(4.5)
    together = sharing_factor([([1.25, 1.5, 1.0], [0.25, 0.3125]), ([1.25, 2.0], [0.25, 0.375])], alone[:2])
    assert together == (1.25, 0.28125, 2.1213)


def test_pdserve_profile_prints_its_stages_and_expected_time_up_front_then_a_line_a_point(tiny_model, tmp_path,
                                                                                         capsys):
    """`pdserve profile --engine-only`: what it will measure first, the expected duration before
    the first point, a line per point, and at the end that the profile is not calibrated for a plan
    (issue 54: the README's profile printed nothing for two minutes and lacked the serving path)."""
    from cluster.app.cli import main

    rc = main(["profile", "--model", tiny_model, "--out", str(tmp_path / "p.json"), "--prefill-tokens", "16,48",
               "--prefill-cached", "0", "--decode-batch", "1,2", "--decode-context", "32", "--reps", "1",
               "--sharing", "0", "--engine-only", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, lines
    assert lines[0] == "pdserve profile: measuring the engine's steps (in-process)"
    assert re.fullmatch(r"expected ~\d+ s in all \(engine steps ~\d+ s\)", lines[1]), lines[1]
    assert [re.sub(r": [0-9.]+ ms .*", "", x) for x in lines[2:6]] == [
        "[1/4] prefill 16 tokens after 0 cached", "[2/4] prefill 48 tokens after 0 cached",
        "[3/4] decode batch 1 at context 32", "[4/4] decode batch 2 at context 32"]
    assert lines[-1] == ("calibrated for a plan: NO, it lacks the serving path's cost (per request, step, stream "
                         "and relayed token); the engine processes' sharing of the cores; the KV transfer (neither "
                         "measured nor stated as assumed)")
    assert Profile.load(tmp_path / "p.json").device["threads"] == 1


def test_a_point_above_a_larger_point_is_an_outlier_to_measure_again():
    """The issue-54 profile's decode rows (ms) at contexts 128, 1024, 2048: batch 1 at 1024 (39.1)
    above batch 1 at 2048 and batch 2 at 1024; batch 2 at 2048 (57.6) above batch 3's; batch 3 at
    1024 (67.5) above both its larger neighbours; ties are not outliers."""
    from cluster.planner.calibrate import outliers

    rows = [[19.3, 39.1, 37.4], [24.7, 30.1, 57.6], [28.3, 67.5, 46.3], [32.7, 40.9, 54.6]]
    assert outliers(rows) == [(0, 1), (1, 2), (2, 1)]
    assert outliers([[1.0, 1.0], [1.0, 2.0]]) == [] and outliers([[3.0]]) == []
