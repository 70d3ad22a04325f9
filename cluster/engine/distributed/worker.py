"""Ranks 1..tp-1: receive the spec, build the rank's shard, then run every forward the driver sends
until it says stop. No scheduler, no pool accounting, no sampling: the driver decides."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from cluster.engine.distributed import step
from cluster.engine.distributed.rank import RankModel
from cluster.engine.distributed.step import Report, Step, Stop, WorkerSpec

log = logging.getLogger(__name__)


class RankExtension(Protocol):
    """What a layer above the engine runs on a rank for messages the engine does not know (KV
    transfer between degrees: kv_transfer/rank_reads.py's RankKV), given by whoever starts the ranks."""

    def handles(self, msg) -> bool: ...

    def handle(self, msg, rank: int, shard: RankModel) -> None: ...

    def close(self) -> None: ...


def serve_rank(rank: int, device: torch.device, extension: RankExtension | None = None) -> int:
    """The worker loop, in a process already in the group; returns the forwards it ran. A forward
    that raises ends the worker (its peers' next collective then fails: the replica is dead)."""
    spec = step.receive()
    if isinstance(spec, Stop):  # the driver refused before building anything
        return 0
    if not isinstance(spec, WorkerSpec):
        raise RuntimeError(f"rank {rank}: expected the WorkerSpec first, got {type(spec).__name__}")
    shard = RankModel.build(spec, rank, device)
    backend = shard.backend(spec, device)
    try:
        while True:
            msg = step.receive()
            if isinstance(msg, Step):
                shard.forward(msg.input_ids, msg.positions, msg.meta, backend, msg.logits_indices)
            elif isinstance(msg, Report):
                step.gather_reports(shard.report(msg.with_kv))
            elif isinstance(msg, Stop):
                return shard.steps
            elif extension is not None and extension.handles(msg):
                extension.handle(msg, rank, shard)
            else:
                raise RuntimeError(f"rank {rank}: unexpected message {type(msg).__name__}")
    finally:
        if extension is not None:
            extension.close()
