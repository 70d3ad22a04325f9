"""What an engine hands back: a request's output deltas, its finish reason, the engine's load and
counters. Plain data, no torch: the front door and the serving layer import it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.errors import ErrorKind


class FinishReason(str, enum.Enum):
    """Why a request ended: the closed set every layer (engine, flow, APIs, metrics) speaks."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    CANCELLED = "cancelled"  # aborted: the client went away or a lease ended
    ERROR = "error"  # this request failed (its input, or a failed step): `error` says why
    DEADLINE = "deadline"  # its deadline passed: work stopped, blocks freed
    REJECTED = "rejected"  # waited in the queue past its time-to-live (overload)
    CONTENT_FILTER = "content_filter"  # a guardrail flagged the output (set by the ingress, never an engine)

    __str__ = str.__str__
    __format__ = str.__format__


# the reasons an engine ends a request unfinished: never merged into the outputs before them
FAILED = (FinishReason.ERROR, FinishReason.DEADLINE, FinishReason.REJECTED)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution (log-softmax of the
    logits before bias, penalties and temperature) and the top-k tokens of that distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """One request's progress in one step (a delta), or its whole result from generate()."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    error_kind: ErrorKind | None = None  # set when finish_reason is "error": whose fault it was
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # the prompt's (SamplingParams.prompt_logprobs), on the first output of the engine that computed it
    prompt_logprobs: list[TokenLogprob | None] | None = None


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(
        b.request_id, a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason,
        b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens, b.error, b.error_kind, logprobs,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


@dataclass
class EngineStats:
    """Plain counters since start; telemetry turns them into metrics."""

    steps: int = 0
    requests_received: int = 0  # queued or imported: with the queues, what tells a load report is due
    tokens_computed: int = 0  # through the model: prompt chunks, recomputes and decodes
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    step_errors: int = 0  # steps that failed: the forward raised, a KV tier save failed, or the step raised
    consecutive_step_errors: int = 0  # since the last step that ran: the replica's health reads it
    last_step_error_at: float = 0.0  # time.monotonic() of the latest failed step
    last_step_s: float = 0.0
    busy_s: float = 0.0  # time spent in steps (tokens_computed / busy_s = throughput when busy)
    step_s_avg: float = 0.0  # step time smoothed over ~10 steps: one long prefill step barely moves it
    # The slow-replica signals, each over one kind of work, so a replica is not "slow" for having
    # been given the long prompts: decode-only steps (smoothed step time), and steps computing
    # prompt tokens (smoothed seconds per token computed).
    decode_steps: int = 0
    decode_step_s_avg: float = 0.0
    prompt_steps: int = 0
    prompt_s_per_token_avg: float = 0.0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (cluster/engine/spec/): verified speculative chunks, their draft tokens
    # proposed and accepted, time spent proposing, and speculation turned off, by reason
    # (per request: grammar, logprobs, penalties, logit_bias, low_acceptance for each pause;
    # per step: batch, the replica's decode batch over max_batch; cost, a request held back because
    # its expected accepted drafts do not pay for their measured cost at this batch).
    spec_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_proposer_s: float = 0.0
    spec_off: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's queues and KV pool at one moment (for load reports, autoscaling, telemetry)."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    importing: int  # decode: KV being pulled
    held: int  # prefill: finished prompts whose blocks are held under a lease
    queued_prefill_tokens: int  # prompt tokens of waiting requests not yet computed nor covered by cached blocks
    quarantined_blocks: int = 0  # held by unsettled transfers: neither free nor used by a request
    running_prompt_tokens: int = 0  # prompt tokens of running requests not computed yet (chunked prefill)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks
