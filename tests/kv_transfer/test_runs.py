"""A pull's blocks as runs contiguous on both sides (kv_transfer/runs.py): no NIXL, no engine."""

import numpy as np
import pytest

from kv_transfer.runs import BlockSpace, block_runs

POOL = (32,)  # one region: a decode pool of 32 blocks
PEER = (32, 8)  # a prefill pool of 32 blocks, then 8 host slots (ids 32..39)


def runs(local, remote, local_regions=POOL, remote_regions=PEER):
    return block_runs(local, remote, local_regions, remote_regions).as_tuples()


def test_consecutive_on_both_sides_is_one_run():
    assert runs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]
    assert runs([9], [0]) == [(9, 0, 1)]


def test_a_gap_on_either_side_starts_a_run():
    assert runs([0, 1, 2, 5, 6], [10, 11, 12, 13, 14]) == [(0, 10, 3), (5, 13, 2)]  # local gap
    assert runs([0, 1, 2, 3], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 2)]  # remote gap
    assert runs([0, 2, 4], [1, 3, 5]) == [(0, 1, 1), (2, 3, 1), (4, 5, 1)]


def test_descending_on_both_sides_is_one_run_in_local_order():
    # A pool hands a freed request's blocks back tail first: both sides often allocate descending.
    assert runs([7, 6, 5, 4], [13, 12, 11, 10]) == [(4, 10, 4)]
    assert runs([3, 1, 2], [23, 21, 22]) == [(1, 21, 3)]


def test_reversed_on_one_side_only_is_one_block_a_run():
    assert runs([3, 4, 5], [9, 8, 7]) == [(3, 9, 1), (4, 8, 1), (5, 7, 1)]
    assert runs([5, 4, 3], [7, 8, 9]) == [(3, 9, 1), (4, 8, 1), (5, 7, 1)]


def test_a_run_never_crosses_a_region_edge():
    # remote 30, 31 are the peer's last pool blocks, 32, 33 its first host slots: other memory
    assert runs([0, 1, 2, 3], [30, 31, 32, 33]) == [(0, 30, 2), (2, 32, 2)]
    assert runs([0, 1, 2], [37, 38, 39]) == [(0, 37, 3)]  # inside the host arena
    assert runs([14, 15, 16, 17], [0, 1, 2, 3], local_regions=(16, 16)) == [(14, 0, 2), (16, 2, 2)]


def test_repeated_or_out_of_range_ids_are_refused():
    with pytest.raises(ValueError, match="local block ids repeat"):
        runs([1, 2, 1], [5, 6, 7])
    with pytest.raises(ValueError, match="remote block ids repeat"):
        runs([1, 2, 3], [5, 6, 5])
    with pytest.raises(ValueError, match="remote block ids .* outside 0..39"):
        runs([0], [40])
    with pytest.raises(ValueError, match="local block ids .* outside 0..31"):
        runs([32], [0])
    with pytest.raises(ValueError, match="outside"):
        runs([-1], [0])
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        runs([0, 1], [0])


def test_every_pair_is_covered_exactly_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        local = rng.permutation(32)[:n].tolist()
        remote = rng.permutation(40)[:n].tolist()
        pairs = {(l0 + k, r0 + k) for l0, r0, length in runs(local, remote) for k in range(length)}
        assert pairs == set(zip(local, remote))
        assert sum(length for *_, length in runs(local, remote)) == n


def test_indices_list_each_run_ascending_and_the_runs_in_descending_local_order():
    # NIXL merges list neighbours contiguous on both sides: inside a run they are; between two
    # listed runs they never are (the later run starts below the earlier one)
    local, remote = block_runs([0, 1, 2, 5, 6, 9], [28, 29, 30, 3, 4, 20], POOL, PEER).indices()
    assert local == [9, 5, 6, 0, 1, 2]
    assert remote == [20, 3, 4, 28, 29, 30]
    local, remote = block_runs([0, 1], [31, 32], POOL, PEER).indices()  # across the peer's region edge
    assert (local, remote) == ([1, 0], [32, 31])


def test_block_descs_are_every_block_in_id_order():
    space = BlockSpace(bases=(1000, 9000), sizes=(2, 1), block_bytes=100, device_id=3)
    assert space.block_descs().tolist() == [[1000, 100, 3], [1100, 100, 3], [9000, 100, 3]]
