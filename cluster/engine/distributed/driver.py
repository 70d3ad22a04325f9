"""Rank 0 of a tensor-parallel replica: the engine's own process. It holds a shard like every
rank, and before each forward sends the step's inputs to the workers (step.py), so the runner
calls it exactly as it calls a whole model; the scheduler, KV accounting and sampler never know."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cluster.engine.attention import AttentionBackend, AttentionMetadata
from cluster.engine.config import EngineConfig
from cluster.engine.distributed import step
from cluster.engine.distributed.plan import check_degree
from cluster.engine.distributed.rank import RankModel
from cluster.engine.distributed.step import (KVPoll, KVRead, KVRegister, KVRelease, RankReport, Report, Step, Stop,
                                             WorkerSpec)
from cluster.engine.model_config import ModelConfig


class TensorParallelDriver:
    def __init__(self, rank: RankModel):
        self.rank = rank
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, mc: ModelConfig, num_blocks: int, max_model_len: int,
              device: torch.device) -> "TensorParallelDriver":
        """Rank 0 of a group whose workers are waiting (launch.py, or a replica's Ray actors): sends them
        the spec, then loads its own shard. A degree the model cannot take is refused first."""
        tp = config.tensor_parallel_size
        check_degree(mc, tp, config.expert_parallel)
        if not dist.is_initialized() or dist.get_world_size() != tp or dist.get_rank() != 0:
            raise RuntimeError(
                f"tensor_parallel_size {tp} needs this process to be rank 0 of a torch.distributed group of "
                f"{tp} ranks whose workers run cluster.engine.distributed.worker: started as local processes "
                "by cluster.engine.distributed.launch, as Ray actors by cluster.serving.tensor_parallel")
        spec = WorkerSpec(config, num_blocks, max_model_len)
        step.send(spec)
        return cls(RankModel.build(spec, 0, device))

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.rank.kv_cache

    @property
    def ops(self):
        return self.rank.ops

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend, logits_indices: torch.Tensor) -> torch.Tensor:
        """The model's call (ModelRunner's): the workers get the same step, then every rank runs it."""
        step.send(Step(input_ids, positions, meta, logits_indices))
        return self.rank.forward(input_ids, positions, meta, backend, logits_indices)

    def reports(self, with_kv: bool = False) -> list[RankReport]:
        """Every rank's report (rank 0's first): KV shape and heads, forwards run, optionally its cache."""
        step.send(Report(with_kv))
        return step.gather_reports(self.rank.report(with_kv))

    # ---- KV transfer between degrees: the workers' parts of a pull (kv_transfer/rank_reads.py) ----

    def kv_register(self, agent_name: str, layout) -> list:
        """Ranks 1..N-1 register their pools (their pulls planned for `layout`, a KVLayout); returns
        their RankPeers in rank order."""
        step.send(KVRegister(agent_name, layout))
        return step.gather_reports(None)[1:]

    def kv_read(self, pull_id: int, peer, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...]) -> None:
        """Ranks 1..N-1 plan and post their parts; a failure shows when they are asked (kv_poll)."""
        step.send(KVRead(pull_id, peer, local_blocks, remote_blocks))

    def kv_poll(self, pull_id: int, ranks: tuple[int, ...], wait_s: float) -> list:
        """The RankPullStates of the pull on `ranks` (workers), each waiting up to wait_s."""
        step.send(KVPoll(pull_id, ranks, wait_s))
        return [answer for answer in step.gather_reports(None)[1:] if answer is not None]

    def kv_release(self, pull_id: int) -> list[bool]:
        step.send(KVRelease(pull_id))
        return step.gather_reports(True)[1:]

    def close(self) -> None:
        """Stop the workers (they leave the group and exit); the caller destroys the group."""
        if not self.closed:
            self.closed = True
            step.send(Stop())
