"""The worker ranks of a tensor-parallel Serve replica, as Ray actors of the replica's placement group.

The builder gives a replica whose pool has `tensor_parallel_size` N > 1 a placement group of N
bundles (cluster/app/builder.py: the replica in bundle 0, rank r in bundle r; STRICT_PACK on one node
by default). Before building its engine the replica starts ranks 1..N-1 here, each a thin actor
running the engine's worker loop (cluster/engine/distributed/worker.py), and joins them as rank 0
over gloo (NCCL on GPUs) at its own node's address; then `LLMEngine` finds the group and drives it as
it drives local processes (launch.py).

A worker's death is the replica's death. A forward that raises leaves the group out of step (some
ranks wait in a collective the others left), so nothing can run on it again: `GroupGuard`, put
around the engine's model from outside, ends the replica's process. Why the forward raised decides
what the step's requests see:
- a rank was lost (its actor died: killed, its node gone; `RayRanks.lost_within`): the process
  ends there and then, before the step can end its requests, so their streams see a dead replica
  and migrate as for any dead decode replica;
- every rank alive, or a rank's loop ended by raising (its forward failed): the forward itself
  failed, and a request of the step may be what broke it (poison). The step ends its requests with
  the error (ErrorKind.FORWARD: the ingress ends them, INTERNAL, and moves none to another replica),
  the guard refuses every later forward, and the process ends EXIT_GRACE_S later, once that error
  is on its way. A poison request used to end this replica, migrate, and end the next one too.
An idle replica learns it from its health check: `RayRanks.lost()` names a rank whose loop has
ended, the check raises, Serve replaces the replica.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

# Bounds the rendezvous and every later collective: a rank that stops answering fails the step
# within this long (the health check, every health_check_period_s, usually notices first).
GROUP_TIMEOUT_S = 60.0
# A forward failed: how long a lost rank has to show (Ray reports a killed actor within ~1 s), which
# tells a lost rank (the requests migrate) from a forward that failed (they end with its error).
LOSS_CHECK_S = 5.0
EXIT_GRACE_S = 2.0  # a failed forward's requests' error leaves the replica before its process ends


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """Rank r (1..N-1) of one replica: joins the group, runs the worker loop until the driver's Stop."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, rank: int, tp: int, address: str, timeout_s: float, backend: str, device: str,
            threads: int) -> int:
        import torch.distributed as dist  # noqa: PLC0415

        from cluster.engine.distributed.launch import join_group  # noqa: PLC0415
        from cluster.engine.distributed.worker import serve_rank  # noqa: PLC0415
        from kv_transfer.rank_reads import RankKV  # noqa: PLC0415

        torch.set_num_threads(threads)
        join_group(rank, tp, address, timeout_s, backend)
        try:
            return serve_rank(rank, torch.device(device), RankKV())  # KV transfer between degrees
        finally:
            dist.destroy_process_group()


@dataclass
class RayRanks:
    """Ranks 1..N-1 of the calling replica, and the calls running their loops (one per rank)."""

    actors: list
    loops: list  # ObjectRef of each rank's `run`: ready = that rank's loop ended (stopped, raised, died)
    nodes: list[str]  # the Ray node of every rank, rank 0 (this replica) first

    @classmethod
    def start(cls, replica_id: str, tp: int, device: torch.device, num_cpus: float, num_gpus: float,
              timeout_s: float = GROUP_TIMEOUT_S) -> "RayRanks":
        """Start the ranks in this replica's placement group (actors named pdserve-tp:<replica>:<rank>)
        and join them as rank 0: blocks until all are placed and joined, each at most timeout_s."""
        from cluster.engine.distributed.launch import collective_backend, host_rendezvous, join_group  # noqa: PLC0415

        pg = ray.util.get_current_placement_group()
        if pg is None or pg.bundle_count < tp:
            raise RuntimeError(
                f"tensor_parallel_size {tp} needs the replica in a placement group of {tp} bundles (one per rank), "
                f"which cluster.app.builder gives a pool's deployment; this replica has "
                f"{'none' if pg is None else f'{pg.bundle_count} bundles'}")
        store, address = host_rendezvous(ray.util.get_node_ip_address(), tp, timeout_s)  # its port held from now
        backend = collective_backend(device)
        threads = max(1, int(num_cpus))
        actors = [RankActor.options(
            num_cpus=num_cpus, num_gpus=num_gpus, name=f"pdserve-tp:{replica_id}:{r}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        ).remote() for r in range(1, tp)]
        ranks = cls(actors, [], [ray.get_runtime_context().get_node_id()])
        try:
            try:
                ranks.nodes += ray.get([a.node.remote() for a in actors], timeout=timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise RuntimeError(f"tensor-parallel workers of {replica_id} not placed within {timeout_s:g} s "
                                   f"(placement group bundles {pg.bundle_specs})") from e
            ranks.loops = [a.run.remote(r, tp, address, timeout_s, backend, device.type, threads)
                           for r, a in enumerate(actors, start=1)]
            join_group(0, tp, address, timeout_s, backend, store=store)
        except Exception:
            ranks.kill()
            raise
        log.info("tensor-parallel replica: rank 0 and %d worker actors joined at %s (%s)", tp - 1, address,
                 backend)
        return ranks

    def lost(self) -> str | None:
        """Why a worker rank is gone (its loop ended: the driver never stops them before the end),
        or None while every rank runs. Does not block."""
        ended, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        if not ended:
            return None
        rank = self.loops.index(ended[0]) + 1
        try:
            steps = ray.get(ended[0], timeout=0)
        except Exception as e:  # noqa: BLE001 — the actor died or its loop raised: either ends the replica
            return f"tensor-parallel rank {rank} is gone: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return f"tensor-parallel rank {rank} stopped after {steps} forwards"

    def lost_within(self, timeout_s: float) -> bool | None:
        """Wait up to `timeout_s` for a rank's loop to end: True when a rank's actor died (killed,
        its node lost), False when a loop ended otherwise (its forward raised, or it stopped), None
        when every loop still runs."""
        ended, _ = ray.wait(self.loops, num_returns=1, timeout=timeout_s)
        if not ended:
            return None
        try:
            ray.get(ended[0], timeout=0)
        except ray.exceptions.RayActorError:
            return True
        except Exception:  # noqa: BLE001 — its loop raised: the forward failed there
            return False
        return False

    def kill(self) -> None:
        """End the worker actors now (the replica is going: nothing of theirs is worth a clean stop)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class GroupGuard:
    """The engine's model (the TensorParallelDriver) as the runner calls it, ending the process when
    a forward raises (the module's docstring says when and how): the group is then out of step and a
    later step would hang or mix up collectives. `exit` and the bounds are injectable for tests."""

    def __init__(self, model, ranks: RayRanks | None = None, exit: Callable[[int], None] = os._exit,
                 loss_check_s: float = LOSS_CHECK_S, grace_s: float = EXIT_GRACE_S):
        self._model = model
        self._ranks = ranks
        self._exit = exit
        self._loss_check_s, self._grace_s = loss_check_s, grace_s
        self.broken = False  # a forward failed: none runs again; the process ends shortly
        self._ended = threading.Event()

    def __call__(self, *args, **kwargs):
        if self.broken:  # never on the broken group: wait for the exit, then fail (tests' exit returns)
            self._ended.wait(2 * self._grace_s)
            raise RuntimeError("the tensor-parallel group is broken; the replica is ending")
        try:
            return self._model(*args, **kwargs)
        except Exception:
            lost = None if self._ranks is None else self._ranks.lost_within(self._loss_check_s)
            if lost:
                log.critical("a tensor-parallel forward failed: a rank is lost, the replica ends now (its "
                             "requests migrate)", exc_info=True)
                self._end()
                raise
            log.critical("a tensor-parallel forward failed with every rank alive: its step's requests end with "
                         "the error, the replica ends in %g s", self._grace_s, exc_info=True)
            self.broken = True
            threading.Timer(self._grace_s, self._end).start()
            raise  # the engine ends the step's requests with it (ErrorKind.FORWARD)

    def _end(self) -> None:
        sys.stderr.flush()
        self._ended.set()
        self._exit(70)  # EX_SOFTWARE

    def wrap_model(self, wrap: Callable[[object], object]) -> None:
        """Put `wrap` around the guarded model (fault injection: cluster/serving/faults.py)."""
        self._model = wrap(self._model)

    def __getattr__(self, name):
        return getattr(self._model, name)


def guard_group(engine, ranks: RayRanks | None = None) -> None:
    """Put GroupGuard around a tensor-parallel engine's model, where its runner calls it."""
    engine.runner.model = GroupGuard(engine.runner.model, ranks)
