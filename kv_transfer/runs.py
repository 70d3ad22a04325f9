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
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class BlockRuns:
    """Runs of a pull, ascending by local id: blocks local[i] + k <- remote[i] + k, k < length[i]."""

    local: np.ndarray  # [runs] int64: first local block id
    remote: np.ndarray  # [runs] int64: first remote block id
    length: np.ndarray  # [runs] int64: blocks

    def __len__(self) -> int:
        return len(self.length)

    def as_tuples(self) -> list[tuple[int, int, int]]:
        return list(zip(self.local.tolist(), self.remote.tolist(), self.length.tolist()))

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) int32 block indices into per-block prepped descriptor lists, which NIXL
        merges into exactly these runs: make_prepped_xfer merges neighbours in the list that are
        contiguous on both sides (ascending), so each run is listed ascending and the runs in
        descending local order (no two listed runs can merge, not even across a region edge
        whose memory happens to be adjacent)."""
        order = np.argsort(-self.local, kind="stable")
        length = self.length[order]
        offsets = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        local = np.repeat(self.local[order], length) + offsets
        remote = np.repeat(self.remote[order], length) + offsets
        return local.astype(np.int32), remote.astype(np.int32)


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int],
               local_regions: Sequence[int], remote_regions: Sequence[int]) -> BlockRuns:
    """The fewest runs that READ remote_ids[i] into local_ids[i] for every i.

    regions: the sizes of each side's regions in id order. A READ's descriptors complete together,
    so their order is free: pairs are taken in local id order, and a prompt whose blocks were
    allocated in descending order on both sides (a pool reuses a freed request's blocks tail
    first) is one run too. Raises ValueError for ids out of range or repeated on either side."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    if local.shape != remote.shape or local.ndim != 1:
        raise ValueError(f"{local.size} local blocks for {remote.size} remote blocks")
    local_region = _regions_of(local, local_regions, "local")
    remote_region = _regions_of(remote, remote_regions, "remote")
    order = np.argsort(local, kind="stable")
    local, remote = local[order], remote[order]
    local_region, remote_region = local_region[order], remote_region[order]
    if np.any(local[1:] == local[:-1]):
        raise ValueError(f"local block ids repeat: {local_ids}")
    if len(np.unique(remote)) != len(remote):
        raise ValueError(f"remote block ids repeat: {remote_ids}")
    joins = ((local[1:] - local[:-1] == 1) & (remote[1:] - remote[:-1] == 1)
             & (local_region[1:] == local_region[:-1]) & (remote_region[1:] == remote_region[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~joins))) if len(local) else np.zeros(0, np.int64)
    length = np.diff(np.append(starts, len(local)))
    return BlockRuns(local[starts], remote[starts], length)


def _regions_of(ids: np.ndarray, sizes: Sequence[int], side: str) -> np.ndarray:
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    if len(ids) and (ids.min() < 0 or ids.max() >= total):
        raise ValueError(f"{side} block ids {ids.tolist()} outside 0..{total - 1}")
    return np.searchsorted(ends, ids, side="right")


@dataclass(frozen=True)
class BlockSpace:
    """One engine's registered block memory: its regions' first addresses and sizes in blocks."""

    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    block_bytes: int
    device_id: int

    def descs(self, first: np.ndarray, length: np.ndarray) -> np.ndarray:
        """[runs, 3] uint64 (address, bytes, device) of runs starting at ids `first` (each inside
        one region, as block_runs makes them)."""
        starts = np.cumsum((0,) + self.sizes[:-1])
        region = np.searchsorted(starts, first, side="right") - 1
        addr = np.asarray(self.bases, dtype=np.int64)[region] + (first - starts[region]) * self.block_bytes
        out = np.empty((len(first), 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr, length * self.block_bytes, self.device_id
        return out

    def block_descs(self) -> np.ndarray:
        """Every block of every region, one descriptor each, in id order: a list to prepare once."""
        n = sum(self.sizes)
        return self.descs(np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64))
