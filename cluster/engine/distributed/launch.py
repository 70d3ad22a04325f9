"""Ranks 1..tp-1 of a tensor-parallel engine as local processes (torch.multiprocessing spawn, gloo
over 127.0.0.1 on a free port); this process is rank 0 and runs the engine. For tests and the
benchmark. A Serve replica starts the same worker loop (worker.serve_rank) in tp - 1 Ray actors of
its placement group and joins them with the same `join_group` (cluster/serving/tensor_parallel.py).

Every wait is bounded: the group's timeout bounds each collective (a hung or dead rank fails the
driver's next step instead of hanging it), and close() joins with a timeout, then kills.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cluster.engine.config import EngineConfig
from cluster.engine.distributed import step
from cluster.engine.distributed.ports import free_port
from cluster.engine.distributed.step import Stop
from cluster.engine.distributed.worker import serve_rank
from cluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


def collective_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo on CPU (NCCL is the same code path, not yet run: issue 41)."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(rank: int, tp: int, init_method: str, timeout_s: float, backend: str = "gloo") -> None:
    """Join the replica's group; rank 0 hosts the rendezvous at `init_method` (tcp://host:port).
    Blocks until all tp ranks joined, at most timeout_s, which also bounds every later collective."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp,
                            timeout=timedelta(seconds=timeout_s))


def _worker_main(rank: int, tp: int, init_method: str, timeout_s: float, threads: int, extension=None) -> None:
    torch.set_num_threads(threads)
    join_group(rank, tp, init_method, timeout_s)
    serve_rank(rank, torch.device("cpu"), extension)
    dist.destroy_process_group()
    # A clean stop skips the interpreter's teardown: there, after the last Python frame, a C++
    # destructor aborted ("terminate called without an active exception", SIGABRT) in about one
    # worker exit in three (torch 2.13, gloo), though every forward and the group's teardown had
    # finished. Nothing is left to flush but stdio. A worker that raises exits through the normal
    # path (exit code 1, its traceback on stderr).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalRanks:
    """The worker processes of one group; this process joined it as rank 0."""

    def __init__(self, processes: list):
        self.processes = processes
        self.exit_codes: list[int | None] | None = None  # set by close()

    @classmethod
    def start(cls, tp: int, timeout_s: float = DEFAULT_TIMEOUT_S, worker_threads: int = 1,
              extension=None) -> "LocalRanks":
        """extension: worker.RankExtension each worker runs (picklable; e.g. kv_transfer's RankKV)."""
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, args=(r, tp, init_method, timeout_s, worker_threads, extension),
                             name=f"tp-rank-{r}", daemon=True) for r in range(1, tp)]
        for p in procs:
            p.start()
        try:
            join_group(0, tp, init_method, timeout_s)
        except Exception:
            cls(procs).kill()
            raise
        return cls(procs)

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Wait for the workers to exit (after the driver's Stop), kill any still running after
        timeout_s, leave the group. Returns their exit codes (0: a clean stop)."""
        for p in self.processes:
            p.join(timeout_s)
        self.exit_codes = [p.exitcode for p in self.processes]
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        return self.exit_codes

    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                log.warning("tensor-parallel worker %s (pid %d) still running: killed", p.name, p.pid)
                p.kill()
                p.join(5)


@contextmanager
def tensor_parallel_engine(config: EngineConfig, timeout_s: float = DEFAULT_TIMEOUT_S,
                           worker_threads: int = 1, extension=None) -> Iterator[tuple[LLMEngine, LocalRanks]]:
    """(an LLMEngine with config.tensor_parallel_size ranks, its worker processes); on exit the
    workers are stopped and joined (ranks.exit_codes: 0 each for a clean stop). extension: as
    LocalRanks.start's (KV transfer between degrees needs kv_transfer.rank_reads.RankKV())."""
    ranks = LocalRanks.start(config.tensor_parallel_size, timeout_s, worker_threads, extension)
    engine = None
    try:
        engine = LLMEngine(config)
        yield engine, ranks
    finally:
        try:
            if engine is not None:
                engine.tensor_parallel.close()
            else:
                step.send(Stop())  # the workers wait for a spec the driver never sent
        except RuntimeError as e:  # a dead peer: close() still joins and kills
            log.warning("could not stop the tensor-parallel workers: %s", e)
        ranks.close()
