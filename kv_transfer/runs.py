"""A pull's blocks as runs: one NIXL descriptor per run of blocks contiguous on both sides.

A block of all layers is one contiguous region (KVLayout.layout "block[L,2,bs,Hkv,D]"), and an
engine registers whole regions of blocks (its pool; a prefill's host arena after it), so block ids
that follow each other inside one region are adjacent memory. NIXL 1.5.1 merged few of pdserve's
per-block descriptors (docs/benchmarks.md, "The engine pull's fixed cost"): a pull of n blocks was
n copies. Runs make it one copy per run.

Ids are numbered across an engine's regions in order: with regions of sizes (num_blocks, host
slots), id num_blocks + s is host slot s. A run never crosses a region's edge on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class BlockRuns:
    """Runs of a pull, ascending by local id: blocks local + k <- remote + k, k < length."""

    runs: tuple[tuple[int, int, int], ...]  # (first local id, first remote id, length in blocks)

    def __len__(self) -> int:
        return len(self.runs)

    def as_tuples(self) -> list[tuple[int, int, int]]:
        return list(self.runs)

    def indices(self) -> tuple[list[int], list[int]]:
        """(local, remote) block indices into per-block prepped descriptor lists, which NIXL
        merges into exactly these runs: make_prepped_xfer merges neighbours in the list that are
        contiguous on both sides (ascending), so each run is listed ascending and the runs in
        descending local order (no two listed runs can merge, not even across a region edge
        whose memory happens to be adjacent)."""
        local, remote = [], []
        for first_local, first_remote, length in reversed(self.runs):
            local.extend(range(first_local, first_local + length))
            remote.extend(range(first_remote, first_remote + length))
        return local, remote


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int],
               local_regions: Sequence[int], remote_regions: Sequence[int]) -> BlockRuns:
    """The fewest runs that READ remote_ids[i] into local_ids[i] for every i.

    regions: the sizes of each side's regions in id order. A READ's descriptors complete together,
    so their order is free: pairs are taken in local id order, and a prompt whose blocks were
    allocated in descending order on both sides (a pool reuses a freed request's blocks tail
    first) is one run too. Raises ValueError for ids out of range or repeated on either side.
    Plain Python, not numpy: a pull follows a model step that left the caches cold, where a
    dozen numpy calls took ~0.4 ms on this CPU (docs/benchmarks.md)."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote blocks")
    _check(local_ids, local_regions, "local")
    _check(remote_ids, remote_regions, "remote")
    local_edges = set(accumulate(local_regions[:-1]))  # ids that start a region (other than 0)
    remote_edges = set(accumulate(remote_regions[:-1]))
    runs: list[tuple[int, int, int]] = []
    for local, remote in sorted(zip(local_ids, remote_ids)):
        if runs:
            first_local, first_remote, length = runs[-1]
            if (local == first_local + length and remote == first_remote + length
                    and local not in local_edges and remote not in remote_edges):
                runs[-1] = (first_local, first_remote, length + 1)
                continue
        runs.append((local, remote, 1))
    return BlockRuns(tuple(runs))


def _check(ids: Sequence[int], sizes: Sequence[int], side: str) -> None:
    total = sum(sizes)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{side} block ids repeat: {list(ids)}")
    if len(ids) and (min(ids) < 0 or max(ids) >= total):
        raise ValueError(f"{side} block ids {list(ids)} outside 0..{total - 1}")


@dataclass(frozen=True)
class BlockSpace:
    """One engine's registered block memory: its regions' first addresses and sizes in blocks."""

    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    block_bytes: int
    device_id: int

    def block_descs(self) -> np.ndarray:
        """[blocks, 3] uint64 (address, bytes, device): every block of every region in id order,
        one descriptor each (a list prepared once per peer)."""
        addr = np.concatenate([base + np.arange(n, dtype=np.int64) * self.block_bytes
                               for base, n in zip(self.bases, self.sizes)])
        out = np.empty((len(addr), 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr, self.block_bytes, self.device_id
        return out
