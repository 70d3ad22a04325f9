"""The host tier's bytes: a preallocated tensor of N blocks in host memory (pinned on CUDA), laid
out like the device pool ([N, L, 2, block_size, H_kv, D]: one block is one contiguous region), and
the copies between the two. The bookkeeping is HostTier (kv_cache/host_tier.py).

Copies are synchronous, one block at a time (a block is contiguous in both tensors): a save
finishes before the allocation that evicted the block returns, a load before the step that reads
it runs. The cost per block is what `python -m cluster.tools.bench.tiers` reports."""

from __future__ import annotations

import os
from typing import Sequence

import torch


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
        for block_id, slot in pairs:
            self.host[slot].copy_(self.device_cache[block_id])

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        for slot, block_id in pairs:
            self.device_cache[block_id].copy_(self.host[slot])
