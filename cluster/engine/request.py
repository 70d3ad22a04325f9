"""A request as the scheduler sees it: token ids and progress, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.engine.kv_cache.hashing import BlockHash
from cluster.engine.outputs import FinishReason, TokenLogprob
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import ErrorKind

if TYPE_CHECKING:
    from cluster.engine.spec.state import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: prompt KV being pulled from a prefill engine
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "cancelled"
    FINISHED_ERROR = "error"
    FINISHED_DEADLINE = "deadline"  # its deadline passed: work stopped, blocks freed
    FINISHED_REJECTED = "rejected"  # waited in the queue past its time-to-live (overload)

    @property
    def finished(self) -> bool:
        return self not in _UNFINISHED  # a tuple: identity compares in C (an enum hashes in Python)

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason(self.value) if self.finished else None


_UNFINISHED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_KV, RequestStatus.RUNNING)


class Priority(enum.IntEnum):
    """Scheduling class: every waiting interactive request is admitted before any batch one."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(frozen=True)
class RequestContext:
    """Who a request belongs to and what it may use; set at the ingress, carried to every engine."""

    tenant: str = "default"
    priority: Priority = Priority.INTERACTIVE
    weight: float = 1.0  # share of compute against other tenants of the same class (fair queueing)
    kv_budget: float = 1.0  # most of a replica's KV pool this tenant's requests may hold
    cache_salt: str = ""  # block-hash salt: tenants with different salts never share cached prefixes
    deadline: float | None = None  # wall-clock time (time.time()): past it the request stops
    # W3C trace context (traceparent, tracestate) of the request's ingress span: engine replicas
    # parent their phase spans on it. Empty when tracing is off (cluster/telemetry/tracing.py).
    trace_context: tuple[tuple[str, str], ...] = ()

    def remaining_s(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (time.time() if now is None else now)


DEFAULT_CONTEXT = RequestContext()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache; -1 = not admitted yet
    num_preemptions: int = 0
    # monotonic: when it last went back to the waiting queue (preempted, its KV import or tier
    # load failed); None while it never did. The queue time-to-live counts from here (else arrival).
    requeued_at: float | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with FINISHED_ERROR: whose fault `error` was
    keep_kv: bool = False  # prefill side: on a normal finish, hold the blocks for a KV transfer
    ctx: RequestContext = DEFAULT_CONTEXT
    # Phase times (monotonic), set only while an EngineProbe watches the engine (telemetry on).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # the first token sampled here (None: it came from prefill)
    last_token_time: float | None = None
    # Speculative decoding (cluster/engine/spec/): this step's draft tokens, set before schedule()
    # and consumed by it, and the request's own speculation state (its proposer index, adaptive k).
    draft_token_ids: tuple[int, ...] = ()
    spec: "SpecState | None" = None
    # With sampling.prompt_logprobs: entry i is prompt token i's logprob (None for the first: nothing
    # comes before it), filled by the runner as the prompt's chunks are computed and sent once, with
    # the first output. None when not asked, or when this engine does not compute the prompt (an import).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self):
        self._all = list(self.prompt_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def cache_salt(self) -> str:
        return self.ctx.cache_salt

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)

    def drop_last_tokens(self, n: int) -> None:
        """Forget the last `n` output tokens (sampled in one speculative step after a stop string
        that ended the request: they are never emitted)."""
        if n:
            del self.output_token_ids[-n:]
            del self._all[-n:]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions known from token ids alone (stop strings are the detokenizer's)."""
        out = self.output_token_ids
        n = len(out)
        last = out[-1]
        sp = self.sampling
        if n >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n >= sp.max_tokens or len(self._all) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
