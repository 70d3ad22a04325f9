"""A simulated request and replica: the state the simulator's parts share."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from router.policy import ReplicaLoad

from cluster.planner.workload import RequestSpec

PREFILL_BLOCKS = 1 << 40  # prefill replicas' KV is not modelled


@dataclass(eq=False)  # identity: two requests in the same state are still two
class SimRequest:
    spec: RequestSpec
    known: int  # tokens whose KV a step may compute (prompt + sampled)
    computed: int = 0  # tokens in the KV cache
    generated: int = 0
    blocks: int = 0  # held on its decode replica
    in_prompt: bool = False  # computing a prompt (or a recompute) on the replica that holds it
    decode: "Replica | None" = None
    remote: bool = False  # prefilled on the prefill pool (the serving path's remote TTFT applies)
    first_token_s: float = -1.0
    last_token_s: float = -1.0
    done_s: float = -1.0


@dataclass(eq=False)
class Replica:
    replica_id: str
    pool: str  # "prefill" | "decode"
    total_blocks: int
    free_blocks: int
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order
    busy: bool = False
    kicked: bool = False  # a step start is pending for this instant
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # computed (prompt chunks and decodes): with busy_s, its measured pace
    step_s: float = 0.0  # a decode step's seconds, smoothed (the router's step_time_s)
    assigned: int = 0  # a decode replica's requests, from routing to their end (some still on prefill)
    draining: bool = False  # the run-time planner is moving it to the other pool: no new work
    flipping: bool = False  # drained; the flip completes at a scheduled instant
    why: str = ""  # the planner's reason for the move under way

    prompt_tokens_left: int = 0  # prompt (or recompute) tokens still to compute here: kept, not summed

    def queue(self, r: SimRequest, front: bool = False) -> None:
        if self.pool == "prefill" or r.known - r.computed > 1:  # a prompt to compute (an import only decodes)
            r.in_prompt = True
            self.prompt_tokens_left += r.known - r.computed
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.replica_id, self.pool, self.free_blocks, self.total_blocks,
                           running=len(self.running), waiting=len(self.waiting),
                           queued_prefill_tokens=self.prompt_tokens_left, step_time_s=self.step_s,
                           tokens_per_s=self.tokens / self.busy_s if self.busy_s > 0 else 0.0)

    def drained(self) -> bool:
        return not (self.busy or self.waiting or self.running or self.assigned)
