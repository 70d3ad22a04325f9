"""Ranks 1..tp-1 of a tensor-parallel engine as local processes (torch.multiprocessing spawn, gloo
over 127.0.0.1); this process is rank 0 and runs the engine. For tests and the
benchmark. A Serve replica starts the same worker loop (worker.serve_rank) in tp - 1 Ray actors of
its placement group and joins them with the same `join_group` (cluster/serving/tensor_parallel.py).

The rendezvous is rank 0's TCPStore, listening on a port the kernel gave it before any worker is
told the address (`host_rendezvous`): no other process can take the port between a check and a
bind, as one could when a checked-free port was handed out and bound later.

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
from cluster.engine.distributed.step import Stop
from cluster.engine.distributed.worker import serve_rank
from cluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


def collective_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo on CPU (NCCL is the same code path, not yet run: issue 41)."""
    return "nccl" if device.type == "cuda" else "gloo"


def host_rendezvous(host: str, tp: int, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """Rank 0: the group's store, listening on a port the kernel chose (port 0), and its address
    host:port for the workers. The port is held from the moment it is known."""
    store = dist.TCPStore(host, 0, tp, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"{host}:{store.port}"


def join_group(rank: int, tp: int, address: str, timeout_s: float, backend: str = "gloo",
               store: dist.Store | None = None) -> None:
    """Join the replica's group at `address` (host:port of rank 0's store; rank 0 passes the store
    it hosts, from host_rendezvous). Blocks until all tp ranks joined, at most timeout_s, which
    also bounds every later collective."""
    if store is None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), tp, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp, timeout=timedelta(seconds=timeout_s))


def _worker_main(rank: int, tp: int, address: str, timeout_s: float, threads: int, extension=None) -> None:
    torch.set_num_threads(threads)
    join_group(rank, tp, address, timeout_s)
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
        store, address = host_rendezvous("127.0.0.1", tp, timeout_s)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, args=(r, tp, address, timeout_s, worker_threads, extension),
                             name=f"tp-rank-{r}", daemon=True) for r in range(1, tp)]
        for p in procs:
            p.start()
        try:
            join_group(0, tp, address, timeout_s, store=store)
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
