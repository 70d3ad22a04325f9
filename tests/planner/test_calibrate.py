"""`pdserve profile`'s measurements on the tiny model: the grid it promises, checked points (the
timings themselves are this machine's, not asserted)."""

from __future__ import annotations

import pytest

from cluster.planner.calibrate import calibrate
from cluster.planner.profile import OutOfRange, Profile


def test_a_small_grid_gives_a_profile_with_its_range(tiny_model, tmp_path):
    lines = []
    prof = calibrate(tiny_model, prefill_tokens=[16, 48], prefill_cached=[0, 32], decode_batch=[1, 3],
                     decode_context=[32, 64], reps=1, device="cpu", log=lines.append)
    assert prof.prefill.xs == (16, 48) and prof.prefill.ys == (0, 32)
    assert prof.decode.xs == (1, 3) and prof.decode.ys == (32, 64)
    assert all(v > 0 for row in prof.prefill.values + prof.decode.values for v in row)
    assert prof.transfer is None and any("transfer not measured" in n for n in prof.notes)
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv_heads x head_dim x fp32
    assert prof.versions["pdserve"] and prof.device["kind"] == "cpu" and len(lines) == 4
    prof.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    with pytest.raises(OutOfRange, match="prefill: tokens=49"):
        loaded.prefill(49, 0)


def test_context_points_must_be_whole_blocks(tiny_model):
    with pytest.raises(ValueError, match="multiples of the block size"):
        calibrate(tiny_model, prefill_cached=[0, 20], reps=1, device="cpu", log=lambda _: None)
