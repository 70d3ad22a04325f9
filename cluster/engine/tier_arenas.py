"""The bytes of the KV tiers below the device pool; their bookkeeping is BlockTier
(kv_cache/tier.py), which calls these copiers.

- HostArena: a preallocated tensor of N blocks in host memory (pinned on CUDA), laid out like
  the device pool ([N, L, 2, block_size, H_kv, D]: one block is one contiguous region).
- DiskArena: one file per block slot in a fresh subdirectory of the configured directory
  (removed when the arena goes), written from the host arena's slot the host tier evicts and read
  straight into a device block.

Copies are synchronous, one block at a time: a save finishes before the allocation that evicted
the block returns (and before its slot is reused), a load before the step that reads it runs.
The cost per block is what `python -m cluster.tools.bench.tiers` reports."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Sequence

import torch

from cluster.engine.kv_cache import BlockTier


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostArena:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int):
        shape = (num_blocks, *device_cache.shape[1:])
        nbytes = num_blocks * device_cache[0].numel() * device_cache.element_size()
        if nbytes > physical_memory_bytes() // 2:
            raise ValueError(
                f"kv_tiers.host_blocks={num_blocks} needs {nbytes / 2**30:.1f} GiB of host memory; at most half "
                f"of this machine's {physical_memory_bytes() / 2**30:.1f} GiB may go to the host tier")
        self.device_cache = device_cache
        self.nbytes = nbytes
        self.host = torch.zeros(shape, dtype=device_cache.dtype, device="cpu",
                                pin_memory=device_cache.device.type == "cuda")

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block id, host slot) pairs."""
        for block_id, slot in pairs:
            self.host[slot].copy_(self.device_cache[block_id])

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host slot, device block id) pairs."""
        for slot, block_id in pairs:
            self.device_cache[block_id].copy_(self.host[slot])


def disk_blocks(directory: str, size_gib: float, block_bytes: int) -> int:
    """Blocks the disk tier holds; raises naming the option when the directory cannot take them."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"kv_tiers.disk_dir {directory!r} is not an existing directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"kv_tiers.disk_dir {directory!r} is not writable")
    n = int(size_gib * 2**30 // block_bytes)
    if n < 1:
        raise ValueError(f"kv_tiers.disk_gb={size_gib:g} holds no block of {block_bytes} bytes")
    free = shutil.disk_usage(d).free
    if n * block_bytes > free:
        raise ValueError(f"kv_tiers.disk_gb={size_gib:g} is more than the {free / 2**30:.2f} GiB free "
                         f"in kv_tiers.disk_dir {directory!r}")
    return n


class DiskArena:
    def __init__(self, host: HostArena, directory: str):
        self.host = host
        self.device_cache = host.device_cache
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-", dir=directory))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.block_bytes = host.device_cache[0].numel() * host.device_cache.element_size()

    def _path(self, slot: int) -> str:
        return str(self.dir / f"{slot}.kv")

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host slot, disk slot) pairs: the host tier's victims, before their slots are reused."""
        for host_slot, slot in pairs:
            # not numpy's tofile: it ignores a failed flush at close, and a full disk there
            # would pass for a save (the block then fails to load, or loads short)
            with open(self._path(slot), "wb") as f:
                f.write(self.host.host[host_slot].view(torch.uint8).numpy())

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(disk slot, device block id) pairs."""
        for slot, block_id in pairs:
            raw = torch.from_file(self._path(slot), shared=False, size=self.block_bytes, dtype=torch.uint8)
            block = self.device_cache[block_id]
            block.copy_(raw.view(block.dtype).view(block.shape))

    def close(self) -> None:
        """Remove the files now (else when the arena is collected or the process exits)."""
        self._cleanup()


def build_tiers(opts, pool: torch.Tensor, block_bytes: int) -> list[BlockTier]:
    """The KV tiers below the pool, top down (host, then disk), with their arenas (none when off)."""
    if not opts.enabled:
        return []
    host = HostArena(pool, opts.host_blocks)
    tiers = [BlockTier("host", opts.host_blocks, host)]
    if opts.disk_dir is not None:
        n = disk_blocks(opts.disk_dir, opts.disk_gb, block_bytes)
        tiers.append(BlockTier("disk", n, DiskArena(host, opts.disk_dir)))
    return tiers
