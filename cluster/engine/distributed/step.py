"""What rank 0 (the driver) sends the other ranks, and the channel it goes through.

The driver decides everything (schedule, block tables, sampling); a worker only runs the forward
it is sent. Every message is broadcast from rank 0 in order, so all ranks run the same sequence of
forwards and collectives. Today the channel is torch.distributed's object broadcast (gloo, one
pickled message a step); a Ray placement group can carry the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cluster.engine.attention import AttentionMetadata
from cluster.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """The first message: what every worker builds (the driver has validated and sized it)."""

    config: EngineConfig
    num_blocks: int  # the same block count on every rank: the driver's pool accounts for all of them
    max_model_len: int


@dataclass(frozen=True)
class Step:
    """One forward's inputs: the runner's tensors (token ids, positions, the rows whose logits are
    wanted) and the attention metadata (slot mapping, block tables, context lengths)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S]


@dataclass(frozen=True)
class Report:
    """Ask every rank for its RankReport (gathered on rank 0); with_kv adds its KV cache."""

    with_kv: bool = False


@dataclass(frozen=True)
class RankReport:
    rank: int
    kv_shape: tuple[int, ...]  # [num_blocks, L, 2, block_size, H_kv on this rank, D]
    kv_heads: tuple[int, int]  # (first KV head, count) of the whole model's heads this rank holds
    steps: int  # forwards executed
    kv_cache: torch.Tensor | None = None


@dataclass(frozen=True)
class Stop:
    pass


# KV transfer between tensor-parallel degrees (kv_transfer/rank_reads.py): each rank registers its
# own pool with its own NIXL agent, plans its own part of a pull from the pull's small inputs and
# posts it; the driver asks about the workers' parts once its own is done. The engine does not
# import kv_transfer: its types are named in comments.


@dataclass(frozen=True)
class KVRegister:
    """Register the rank's pool as agent f"{agent_name}-rank{r}"; every rank answers its RankPeer."""

    agent_name: str
    layout: object  # KVLayout of the replica's pool: each rank plans its pulls' parts for it


@dataclass(frozen=True)
class KVRead:
    """Start pull `pull_id` of remote_blocks[i] into local_blocks[i] from `peer` (a PeerInfo, which
    lists the peer's ranks): each worker plans its own part and posts it (rank 0 posts its own)."""

    pull_id: int
    peer: object
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


@dataclass(frozen=True)
class KVPoll:
    """The ranks in `ranks` answer their part's state (a RankPullState), each waiting up to wait_s
    while it runs; the other ranks answer None."""

    pull_id: int
    ranks: tuple[int, ...]
    wait_s: float


@dataclass(frozen=True)
class KVRelease:
    """Let go of the pull (cancel it if still running); every rank answers whether NIXL let go."""

    pull_id: int


Message = WorkerSpec | Step | Report | Stop | KVRegister | KVRead | KVPoll | KVRelease


def send(message: Message) -> None:
    """Rank 0: one message to every rank (each receives it with `receive`)."""
    dist.broadcast_object_list([message], src=0)


def receive() -> Message:
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_reports(report):
    """Every rank's answer (a RankReport, or to a KV message its answer), in rank order, on rank 0
    (None elsewhere)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(report, out, dst=0)
    return out
