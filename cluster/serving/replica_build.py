"""What a replica is built from (cluster/serving/replica.py): its engine (with a tensor-parallel
replica's worker ranks), the NIXL transport over the engine's pool, the registry that publishes it,
and, only with fault_tolerance.fault_injection, the fault wrappers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster.config import AppConfig, TelemetryOptions
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine, resolve_device
from cluster.serving import faults
from cluster.serving.registry import RayMetadataStore, get_registry
from cluster.serving.tensor_parallel import RayRanks, guard_group
from cluster.telemetry.replica import ReplicaTelemetry
from kv_transfer.layout import engine_layout
from kv_transfer.stats import TransferStats
from kv_transfer.transport import NixlTransport


def build_engine(config: AppConfig, pool: Literal["prefill", "decode"],
                 replica_id: str) -> tuple[LLMEngine, RayRanks | None]:
    """The pool's engine; with tensor_parallel_size > 1 its worker ranks first, as Ray actors of
    this replica's placement group (cluster/serving/tensor_parallel.py), which the engine drives,
    and a failed forward ends the replica (GroupGuard)."""
    engine_config = EngineConfig(model=config.model, **config.engine_for(pool).model_dump())
    if engine_config.tensor_parallel_size == 1:
        return LLMEngine(engine_config), None
    opts = getattr(config, pool)
    ranks = RayRanks.start(replica_id, engine_config.tensor_parallel_size, resolve_device(engine_config.device),
                           num_cpus=opts.num_cpus, num_gpus=opts.num_gpus)
    try:
        engine = LLMEngine(engine_config)
        guard_group(engine, ranks)
        return engine, ranks
    except Exception:
        ranks.kill()
        raise


def make_replica_telemetry(options: TelemetryOptions, engine: LLMEngine, transfer_stats: TransferStats,
                           pool: str, replica_id: str, feed=None, replies=None):
    """The replica's metrics and traces exporter; None (and no probe in the engine) when both are off."""
    if not options.metrics and options.traces == "none":
        return None
    return ReplicaTelemetry(options, engine, transfer_stats, pool, replica_id, feed, replies)


def serve_replica_id() -> str | None:
    """Serve's id of this replica: routing decisions name replicas by it."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not running as a Serve replica
        return None


def rank_of(rank) -> int | None:
    """A Serve rank as an int: Serve passes a ReplicaRank (its `rank`: 0..N-1 in its deployment)."""
    return getattr(rank, "rank", rank)


def serve_replica_rank() -> int | None:
    """This replica's rank in its deployment (what places it in a cell: router/cells.py)."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        return rank_of(serve.get_replica_context().rank)
    except RayServeException:  # not running as a Serve replica
        return None


@dataclass
class EngineStack:
    """A replica's engine and what is built around it, once; every role it plays runs over these."""

    engine: LLMEngine
    ranks: RayRanks | None  # a tensor-parallel replica's worker ranks
    transport: NixlTransport
    registry: RayMetadataStore
    faults: faults.Faults | None  # only with fault_tolerance.fault_injection

    @classmethod
    def build(cls, cfg: AppConfig, pool: Literal["prefill", "decode"], replica_id: str) -> EngineStack:
        engine, ranks = build_engine(cfg, pool, replica_id)
        try:
            kv = cfg.kv_transfer
            registry = RayMetadataStore(get_registry(), kv.registry_timeout_s)
            transport = NixlTransport(
                replica_id, engine.kv_cache, engine_layout(engine), registry,
                required_transports=kv.required_transports, num_threads=kv.nixl_threads,
                progress_thread=kv.progress_thread,
                host_cache=engine.host_arena() if pool == "prefill" else None,  # kv_tiers.lease_from_host
                tensor_parallel=engine.tensor_parallel,  # a tp replica registers every rank's pool
            )
        except BaseException:  # the ranks would outlive a replica that never was
            if ranks is not None:
                ranks.kill()
            raise
        injected = faults.install(engine, transport) if cfg.fault_tolerance.fault_injection else None
        return cls(engine, ranks, transport, registry, injected)
