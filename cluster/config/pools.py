"""The pools: each pool's replicas and engine, its autoscaling, the KV transfer between them, the routing
policy and fault tolerance."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, FieldSerializationInfo, field_serializer, field_validator, model_validator

from cluster.config.common import Strict, as_written
from cluster.engine.config import EngineOptions


class ServingEngineOptions(EngineOptions):
    """The engine's options (cluster/engine/config.py), with a server's defaults for overload: an
    in-process engine queues without bound, a replica refuses past these (429)."""

    max_waiting: int | None = Field(512, ge=0, description="Per replica; more waiting requests are refused (429)")
    queue_ttl_s: float | None = Field(30.0, gt=0, description="Waiting this long in the queue (since arrival, or since "
                                      "it went back to the queue: preempted, a failed import) -> rejected (429)")


class AutoscalingOptions(Strict):
    """One pool's autoscaling (cluster/serving/autoscaling.py): prefill on queued prompt tokens and TTFT,
    decode on KV use and inter-token latency; up fast, down slowly. A pool reads only its own two
    targets. Set a target above what the pool can ever reach to scale on the other signal alone."""

    min_replicas: int = Field(
        1, ge=0, description="0: the pool sleeps after idle_timeout_s without a request and the next request wakes "
        "it (it waits while a replica loads, bounded by its deadline)")
    idle_timeout_s: float = Field(300.0, gt=0, description="With min_replicas 0: no request this long -> 0 replicas")
    max_replicas: int = Field(1, ge=1)
    target_queued_prefill_tokens: float = Field(
        8192, gt=0, description="prefill: prompt tokens waiting per replica (~ throughput x accepted queueing)")
    target_ttft_s: float = Field(1.0, gt=0, description="prefill: time to first token at the replica")
    target_kv_usage: float = Field(0.8, gt=0, le=1, description="decode: fraction of KV blocks held by requests")
    target_itl_s: float = Field(0.05, gt=0, description="decode: interval between a request's tokens")
    upscale_delay_s: float = Field(5.0, ge=0, description="Above target this long: add replicas (all needed at once)")
    downscale_delay_s: float = Field(300.0, ge=0, description="Slack this long: remove downscale_step replicas")
    downscale_threshold: float = Field(
        0.6, gt=0, lt=1, description="Slack = the pool would stay below this fraction of its targets with one fewer")
    downscale_step: int = Field(1, ge=1, description="Replicas removed per scale-down")
    look_back_period_s: float = Field(5.0, gt=0, description="Serve averages each replica's reports over this window")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas send their reports to Serve")

    @model_validator(mode="after")
    def _consistent(self) -> "AutoscalingOptions":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must be longer than metrics_interval_s")
        return self


class PoolOptions(Strict):
    num_replicas: int = Field(1, ge=0, description="0 for the prefill pool: decode prefills locally")
    autoscaling: AutoscalingOptions | None = None
    num_cpus: float = Field(1.0, ge=0, description="Per replica; with engine.tensor_parallel_size N, per rank (N x a replica)")
    num_gpus: float = Field(0.0, ge=0, description="Per replica; with engine.tensor_parallel_size N, per rank (N x a replica)")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="With engine.tensor_parallel_size N > 1: how the placement group of a replica's N "
        "ranks (one bundle of num_cpus and num_gpus each; the pool's custom resources in the first) is laid over "
        "nodes. STRICT_PACK keeps a replica's collectives on one node")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {pdserve_decode: 1}: "
        "the pool runs only on nodes that advertise them (deploy/cluster.yaml)")
    max_ongoing_requests: int = Field(256, ge=1)
    compute_nice: int = Field(
        10, ge=0, le=19, description="OS niceness of the engine's compute thread (and the torch threads it "
        "starts): where engines share cores with the front door, its event loops (admission, token relay) "
        "run first; 0 = same priority (docs/architecture.md, 'CPU priority')")
    stream_interval: int | Literal["auto"] = Field(
        "auto", description="Tokens per streamed message after the first (vLLM's --stream-interval): 1 sends each "
        "token alone; auto sends 1 up to 8 streams on a replica, then one more per 8 streams, up to 8, so the "
        "per-message cost (replica, Ray, ingress relay, client frame) stays flat as streams grow. The first token, "
        "the end and a failure go at once (decode and colocated replicas)")
    engine: ServingEngineOptions | None = Field(
        None, description="This pool's engine: laid over the app-wide (or the version's) `engine` key by key, the "
        "keys set here win")

    @field_serializer("engine")
    def _as_written(self, section, info: FieldSerializationInfo):
        return as_written(section, info)

    @field_validator("stream_interval")
    @classmethod
    def _interval(cls, v: int | str) -> int | str:
        if v != "auto" and not 1 <= v <= 64:
            raise ValueError(f"must be 'auto' or 1..64 tokens, got {v}")
        return v

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name} is not a custom resource: use num_cpus / num_gpus")
            if amount <= 0:
                raise ValueError(f"resource {name}: must be > 0, got {amount}")
        return resources


class KVTransferOptions(Strict):
    lease_s: float = Field(30.0, gt=0, description="How long prefill holds a request's blocks for decode")
    timeout_s: float = Field(10.0, gt=0, description="Decode gives up on a pull after this long")
    min_lease_left_s: float | None = Field(
        None, ge=0, description="Decode pulls only while the handle's lease has this long left, else it "
        "recomputes the prompt (prefill's wall clock: nodes need NTP); None = timeout_s")
    release_grace_s: float = Field(
        2.0, ge=0, description="Prefill keeps the blocks of a lease that expired or was released without a "
        "completed READ this much longer before reusing them (a decode may still be reading)")
    failure_policy: Literal["recompute", "fail"] = "recompute"
    required_transports: list[str] = Field(default_factory=list, description='e.g. ["cuda_ipc", "rc"]')
    nixl_threads: int = Field(0, ge=0)
    progress_thread: bool = Field(
        False, description="NIXL's progress thread: lower transfer latency, but it spins one core per replica")
    registry_timeout_s: float = Field(
        2.0, gt=0, description="Longest the engine loop waits for the registry actor (a handshake's peer "
        "lookup); no answer = a failed pull, which the failure policy handles")

    @model_validator(mode="after")
    def _lease_outlasts_margin(self) -> "KVTransferOptions":
        margin = self.timeout_s if self.min_lease_left_s is None else self.min_lease_left_s
        if margin >= self.lease_s:
            raise ValueError(f"min_lease_left_s ({margin:g}; default timeout_s) must be below lease_s "
                             f"({self.lease_s:g}), or every pull is refused")
        return self


class PlannerOptions(Strict):
    """The run-time planner (cluster/planner/runtime.py): moves replicas between the prefill and
    decode pools when one is over its bound and the other can spare one (drain, flip the role,
    weights kept). The bounds come from telemetry.slo: the prefill queue against ttft_share of
    its TTFT, decode KV against kv_high of the pool's blocks and decode steps against its ITL."""

    enabled: bool = Field(False, description="Run the planner (a disaggregated app only); off: the split is fixed")
    interval_s: float = Field(5.0, gt=0, description="Seconds between decisions")
    patience: int = Field(3, ge=1, description="Decisions in a row that must ask for the same move")
    cooldown_s: float = Field(30.0, ge=0, description="Seconds after a move before the next")
    high: float = Field(1.0, gt=0, description="Pressure (measured / bound) at which a pool asks for a replica")
    low: float = Field(0.6, gt=0, description="The other pool gives one only if, one smaller, it stays at or under this")
    ttft_share: float = Field(0.5, gt=0, le=1, description="Share of the TTFT objective the prefill queue may take")
    kv_high: float = Field(0.9, gt=0, le=1, description="Share of the decode pool's KV blocks that is its bound")
    drain_timeout_s: float = Field(60.0, gt=0, description="A move whose replica has not drained by then is called off")
    hysteresis_s: float = Field(300.0, ge=0, description="Seconds after a move before a move the other way (a flip "
                                "is not undone by the next swing of the load)")
    move_timeout_s: float | None = Field(None, gt=0, description="The longest a move may take, drain included, "
                                         "before it is recorded as timed out; None: drain_timeout_s + 30 s")

    @model_validator(mode="after")
    def _low_under_high(self) -> "PlannerOptions":
        if self.low >= self.high:
            raise ValueError(f"planner.low {self.low:g} must be under planner.high {self.high:g} (else a move "
                             "would ask for the move back)")
        if self.move_timeout_s is not None and self.move_timeout_s <= self.drain_timeout_s:
            raise ValueError(f"planner.move_timeout_s {self.move_timeout_s:g} must exceed planner.drain_timeout_s "
                             f"{self.drain_timeout_s:g} (else a slow drain times out before it is called off)")
        return self


class RoutingOptions(Strict):
    enabled: bool = Field(True, description="Route through the router actor; off = Serve's power of two")
    strategy: Literal["cost", "round_robin", "power_of_two"] = Field(
        "cost", description="cost: prefix- and capacity-aware; the others are baselines for comparison")
    local_prefill_threshold: int = Field(
        64, ge=0, description="Fewer uncached prompt tokens than this on the decode replica: prefill there")
    hot_load_cap: int = Field(32, ge=1, description="Requests on a replica past which its cache earns no credit")
    slow_factor: float = Field(2.0, gt=1, description="Step time this many times the pool median: deprioritised")
    pull_block_cost: float | None = Field(
        None, ge=0, description="Tokens of work one KV block a decode replica lacks costs its pull (on top of the "
        "block itself); None: measured (decode's seconds per pulled block x the prefill pool's tokens/s)")
    evict_block_cost: float = Field(
        4.0, ge=0, description="Tokens charged for each cached block a prompt would push out of a replica's cache "
        "(what makes prefixes spread over the pool instead of thrashing one replica)")
    tier_weights: list[float] | None = Field(
        None, max_length=2, description="Credit of a cached block in a replica's host tier, then its disk tier "
        "(engine.kv_tiers), against one in its device pool (1.0): loaded back, not computed, but the load costs. "
        "None: measured per replica (1 - its seconds per block loaded x its tokens computed a second / block size; "
        "0.75 host, 0.25 disk until it has loaded from that tier)")
    session_bonus: float = Field(
        256.0, ge=0, description="Tokens of work by which the replicas that served a session last are preferred "
        "(a soft preference: more load than this moves the session; 0 turns affinity off)")
    max_sessions: int = Field(100_000, ge=1, description="Sessions the router remembers (least recently used go first)")
    session_ttl_s: float = Field(600.0, gt=0, description="A session idle this long is forgotten by the router")
    cell_size: int = Field(
        32, ge=1, le=4096, description="Routers in cells (router/cells.py): a model version whose replicas, at "
        "most (num_replicas, or autoscaling.max_replicas, both pools), exceed this is split into "
        "ceil(replicas / cell_size) cells, each with its own router; replicas join a cell by rendezvous hashing of "
        "their id and a request by its first block (or session key). At or below it: one router, as without cells")
    cell_choice: Literal["two", "spill"] = Field(
        "two", description="With cells, which cell decides a request. two: its first two cells (by rendezvous "
        "hashing) each price it, the cheaper decides; spill: its first cell, unless the replica chosen there to "
        "compute the prompt holds cell_spill_requests prompts (then the second)")
    cell_max_choices: int = Field(
        8, ge=2, le=64, description="With cell_choice two: the most cells one hot prefix is spread over. The ingress "
        "counts each prefix's share of its last 1,024 requests; one past half a cell's share (1 / (2 x cells)) has "
        "its two priced cells drawn from its first ceil(4 x share x cells) by rendezvous hashing, at most this many "
        "(2: its first two always)")
    cell_spill_requests: int | None = Field(
        None, ge=1, description="With cell_choice spill: a request whose replica chosen in its cell to compute the "
        "prompt holds at least this many prompts (a prefill replica's running and waiting requests, a decode "
        "replica's waiting ones; those sent since its last report included) goes to its prefix's second-ranked "
        "cell instead. None: hot_load_cap")


    @model_validator(mode="after")
    def _spill_needs_spill(self) -> "RoutingOptions":
        if self.cell_spill_requests is not None and self.cell_choice != "spill":
            raise ValueError(f"routing.cell_spill_requests applies only with routing.cell_choice 'spill' (it is "
                             f"{self.cell_choice!r}): set both, or neither")
        if "cell_max_choices" in self.model_fields_set and self.cell_choice != "two":
            raise ValueError(f"routing.cell_max_choices applies only with routing.cell_choice 'two' (it is "
                             f"{self.cell_choice!r})")
        return self

    @field_validator("tier_weights")
    @classmethod
    def _weights(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and not all(0 <= w <= 1 for w in v):
            raise ValueError(f"each weight must be in [0, 1], got {v}")
        return v


class FaultToleranceOptions(Strict):
    max_migrations: int = Field(
        2, ge=0, description="Times a request may move to another decode replica when its replica dies")
    replica_wait_s: float = Field(
        120.0, gt=0, description="Longest a request waits for a decode replica to take it, or for a prefill "
        "replica's answer (a pool waking from zero, every replica's queue full, replicas that keep dying) when its "
        "deadline does not end the wait first; then UNAVAILABLE, counted against the version by the rollout gate")
    stuck_loop_s: float = Field(
        30.0, gt=0, description="An engine loop turn running this long fails the replica's health check")
    max_consecutive_step_errors: int = Field(
        8, ge=1, description="This many engine steps failing in a row (none ran since) fails the replica's "
        "health check; the router avoids a replica whose last step failed")
    fault_injection: bool = Field(
        False, description="Allow inject_fault() on replicas (chaos tests and drills; off in production)")
