"""Loads from the KV tiers into the device pool, off the engine's step.

A request whose prefix sits in a lower tier is admitted with fresh device blocks for it; the
copies run on one loader thread while the engine keeps stepping its other requests, and the
request computes nothing until `KVCacheManager.poll_loads` sees its copy finished (vLLM's
WAITING_FOR_REMOTE_KVS, for a local tier). The thread only moves bytes (`BlockTier.copy`); every
piece of bookkeeping (pins, the pool's index, stats) stays on the engine's thread.

`threaded=False` runs each copy at submit, on the caller's thread (no thread: kv_tiers.async_loads
off, the scheduler's tests). Short copies run there even with a thread (KVCacheManager.load_inline):
waiting a step for a copy of a few blocks costs more than the copy.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Callable, Sequence

from cluster.engine.kv_cache.block_pool import Block
from cluster.engine.kv_cache.hashing import BlockHash


@dataclass
class LoadJob:
    """One request's copy from the tiers: `loads` ((tier index, hash)) into `blocks`, in order."""

    request_id: str
    loads: tuple[tuple[int, BlockHash], ...]
    blocks: list[Block]
    num_prefix: int  # leading blocks of the request's table once loaded (device hits + loads)
    future: cf.Future = field(default_factory=cf.Future)
    quarantine: int = 0  # the request ended during the copy: its blocks' quarantine token


class TierLoader:
    def __init__(self, threaded: bool = True):
        self.threaded = threaded
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-load") if threaded else None

    def submit(self, copy: Callable[[], Sequence[float]]) -> cf.Future:
        """Run `copy` (returns seconds per tier) on the loader thread, or now when not threaded."""
        return self._pool.submit(copy) if self._pool is not None else self.run_here(copy)

    @staticmethod
    def run_here(copy: Callable[[], Sequence[float]]) -> cf.Future:
        """Run `copy` now, on this thread; its outcome in a done future, as a threaded copy's."""
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(copy())
        except Exception as e:  # the same outcome a threaded copy's failure has
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
