"""Ranks 1..tp-1: receive the spec, build the rank's shard, then run every forward the driver sends
until it says stop. No scheduler, no pool accounting, no sampling: the driver decides."""

from __future__ import annotations

import logging

import torch

from cluster.engine.distributed import step
from cluster.engine.distributed.rank import RankModel
from cluster.engine.distributed.step import KVPoll, KVRead, KVRegister, KVRelease, Report, Step, Stop, WorkerSpec

log = logging.getLogger(__name__)


def serve_rank(rank: int, device: torch.device) -> int:
    """The worker loop, in a process already in the group; returns the forwards it ran. A forward
    that raises ends the worker (its peers' next collective then fails: the replica is dead)."""
    spec = step.receive()
    if isinstance(spec, Stop):  # the driver refused before building anything
        return 0
    if not isinstance(spec, WorkerSpec):
        raise RuntimeError(f"rank {rank}: expected the WorkerSpec first, got {type(spec).__name__}")
    shard = RankModel.build(spec, rank, device)
    backend = shard.backend(spec, device)
    agent = None  # this rank's NIXL agent, once the engine's transport registers the ranks
    try:
        while True:
            msg = step.receive()
            if isinstance(msg, Step):
                shard.forward(msg.input_ids, msg.positions, msg.meta, backend, msg.logits_indices)
            elif isinstance(msg, Report):
                step.gather_reports(shard.report(msg.with_kv))
            elif isinstance(msg, Stop):
                return shard.steps
            elif isinstance(msg, (KVRegister, KVRead, KVPoll, KVRelease)):
                agent = _kv_message(msg, rank, shard, agent)
            else:
                raise RuntimeError(f"rank {rank}: unexpected message {type(msg).__name__}")
    finally:
        if agent is not None:
            agent.close()


def _kv_message(msg, rank: int, shard: RankModel, agent):
    """This rank's part of KV transfer between degrees (kv_transfer/rank_reads.py)."""
    from kv_transfer.rank_reads import RankAgent, RankPullState  # noqa: PLC0415 — NIXL only when used

    if isinstance(msg, KVRegister):
        if agent is not None:
            agent.close()
        agent = RankAgent(f"{msg.agent_name}-rank{rank}", shard.kv_cache)
        step.gather_reports(agent.peer())
    elif isinstance(msg, KVRead):
        agent.post(msg.pull_id, msg.reads[rank])
    elif isinstance(msg, KVPoll):
        step.gather_reports(RankPullState(rank, agent.state(msg.pull_id), agent.bytes_read))
    else:
        step.gather_reports(agent.release(msg.pull_id))
    return agent
