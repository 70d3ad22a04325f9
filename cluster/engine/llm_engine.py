"""The synchronous engine: validate, schedule, run, sample, detokenize.

    out = scheduler.schedule()
    sampled = runner.execute(out.chunks, block_tables)
    finished = scheduler.update(out, sampled.tokens)  # sampled.failed: ended alone first

Not thread-safe: AsyncEngine drives it from one thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cluster.engine.attention import resolve_backend
from cluster.engine.config import EngineConfig
from cluster.engine.kv_cache import KVCacheManager, extend_salt
from cluster.engine.model.loader import load_model
from cluster.engine.model_config import ModelConfig
from cluster.engine.model_runner import ModelRunner
from cluster.engine.request import DEFAULT_CONTEXT, Request, RequestContext, RequestStatus
from cluster.engine.sampler import RequestFailure
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.probe import EngineProbe
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.engine.validation import RequestValidator
from cluster.errors import ErrorKind

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One request's progress in one step (a delta), or its whole result from generate()."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    error_kind: ErrorKind | None = None  # set when finish_reason is "error"


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    return RequestOutput(
        b.request_id, a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason,
        b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens, b.error, b.error_kind,
    )


@dataclass
class EngineStats:
    """Plain counters since start; telemetry turns them into metrics."""

    steps: int = 0
    tokens_computed: int = 0  # through the model: prompt chunks, recomputes and decodes
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    step_errors: int = 0
    last_step_s: float = 0.0
    busy_s: float = 0.0  # time spent in steps (tokens_computed / busy_s = throughput when busy)
    step_s_avg: float = 0.0  # step time smoothed over ~10 steps: one long prefill step barely moves it
    finished_by_reason: dict[str, int] = field(default_factory=dict)


def kv_block_bytes(mc: ModelConfig, opts) -> int:
    """Bytes of one KV block (all layers, K and V) for these engine options."""
    dtype = getattr(torch, mc.dtype if opts.dtype == "auto" else opts.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    return mc.num_layers * 2 * opts.block_size * mc.num_kv_heads * mc.head_dim * elem


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model)
        mc = self.model_config
        self.device = resolve_device(config.device)
        dtype = getattr(torch, mc.dtype if config.dtype == "auto" else config.dtype)
        self.dtype = dtype
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_size = config.block_size
        self.model = load_model(config.model, mc, self.max_model_len, dtype, self.device)

        # One block of all layers is one contiguous region: [L, 2, block_size, H_kv, D].
        self.block_bytes = kv_block_bytes(mc, config)
        num_blocks = config.num_blocks or int(config.kv_cache_memory_gb * 2**30 // self.block_bytes)
        self.kv_cache = torch.zeros(
            num_blocks, mc.num_layers, 2, config.block_size, mc.num_kv_heads, mc.head_dim,
            dtype=dtype, device=self.device,
        )
        salt = extend_salt(mc.fingerprint().encode(), config.cache_salt)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, salt)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   config.max_waiting, config.queue_ttl_s)
        backend = resolve_backend(config.attention_backend, self.device, config.block_size)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, config.block_size, self.device, config.seed)
        self.eos_token_ids = mc.eos_token_ids or tuple(
            t for t in [self.tokenizer.token_to_id(self.tokenizer.config.get("eos_token"))] if t is not None
        )
        self.validator = RequestValidator(
            self.tokenizer, mc.vocab_size, self.max_model_len, config.block_size, num_blocks, self.eos_token_ids,
            config.limits,
        )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.stats = EngineStats()
        self.probe: EngineProbe | None = None  # set by a replica with telemetry on (plain Python, no Ray)
        self.step_delay_s = 0.0  # injected fault (chaos tests): every step takes this much longer
        log.info(
            "engine ready: model=%s dtype=%s device=%s attention=%s blocks=%d x %d tokens (%.1f MiB)",
            config.model, mc.dtype, self.device, backend.name, num_blocks, config.block_size,
            num_blocks * self.block_bytes / 2**20,
        )

    @classmethod
    def from_model(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests ----------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        ctx: RequestContext = DEFAULT_CONTEXT,
    ) -> Request:
        """Validate and tokenize. Pure (no engine state touched), so any thread may call it."""
        return self.validator.make_request(request_id, prompt, prompt_token_ids, sampling, ctx)

    def check_length(self, n_prompt: int, max_tokens: int) -> None:
        self.validator.check_length(n_prompt, max_tokens)

    def add(self, req: Request) -> None:
        self.scheduler.add(req)
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling.stop)

    def add_request(self, request_id: str, prompt=None, prompt_token_ids=None, sampling=None) -> Request:
        req = self.make_request(request_id, prompt, prompt_token_ids, sampling)
        self.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        return None if req is None else self.final_output(req, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def detokenizer_for(self, req: Request, context: Sequence[int]) -> None:
        """Start a request's text stream after `context` (e.g. prompt + a token sent elsewhere)."""
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, context, req.sampling.stop)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        expired = [self.final_output(r, [], "") for r in self.scheduler.expire(time.time(), time.monotonic())]
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if out.is_empty:
            return expired
        t0 = time.perf_counter()
        tables = {c.request.request_id: self.kv.block_ids(c.request.request_id) for c in out.chunks}
        try:
            sampled = self.runner.execute(out.chunks, tables)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        except Exception as e:  # a broken step fails its requests, never the loop
            log.exception("engine step failed")
            self.stats.step_errors += 1
            failure = RequestFailure(ErrorKind.INTERNAL, f"engine step failed: {type(e).__name__}: {e}")
            return expired + self._fail({c.request.request_id: failure for c in out.chunks})
        # Requests whose own numbers failed end alone, before update(), which then skips them.
        outputs = expired + self._fail(sampled.failed)
        self.scheduler.update(out, sampled.tokens)
        self.stats.steps += 1
        self.stats.last_step_s = time.perf_counter() - t0
        self.stats.busy_s += self.stats.last_step_s
        avg = self.stats.step_s_avg
        self.stats.step_s_avg = self.stats.last_step_s if avg == 0 else 0.9 * avg + 0.1 * self.stats.last_step_s
        if self.probe is not None:
            self.probe.step(out, time.monotonic(), self.stats.last_step_s)

        self.stats.tokens_computed += out.num_tokens
        for c in out.chunks:
            req = c.request
            if req.request_id not in sampled.tokens:  # nothing to sample yet, or failed
                continue
            if req.num_output_tokens == 1:  # its prompt is done: count what the cache saved once
                self.stats.cached_prompt_tokens += req.num_cached_tokens
            self.stats.generation_tokens += 1
            token = req.output_token_ids[-1]
            detok = self._detok[req.request_id]
            detok.add(token)
            if detok.stopped and not req.status.finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            finished = req.status.finished
            text = detok.take(final=finished)
            if finished:
                outputs.append(self.final_output(req, [token], text))
            else:
                outputs.append(self._delta(req, [token], text))
        return outputs

    def _fail(self, failures: dict[str, RequestFailure]) -> list[RequestOutput]:
        """End these requests with finish reason "error" (blocks freed); their terminal outputs."""
        outputs = []
        for rid, failure in failures.items():
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            if req is None:
                continue
            log.warning("request %s failed (%s): %s", rid, failure.kind.value, failure.reason)
            req.error, req.error_kind = failure.reason, failure.kind
            outputs.append(self.final_output(req, [], ""))
        return outputs

    def _delta(self, req: Request, tokens: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            req.request_id, tokens, text, False, None,
            req.num_prompt_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0),
        )

    def final_output(self, req: Request, tokens: list[int], text: str) -> RequestOutput:
        self._detok.pop(req.request_id, None)
        self.runner.sampler.release(req.request_id)
        reason = req.status.finish_reason
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1
        if self.probe is not None:
            self.probe.finished(req)
        kind = req.error_kind or (ErrorKind.INTERNAL if req.status == RequestStatus.FINISHED_ERROR else None)
        return RequestOutput(
            req.request_id, tokens, text, True, reason,
            req.num_prompt_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0), req.error, kind,
        )

    # ---- convenience -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, all at once (continuous batching); results in input order."""
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            rid = f"generate-{id(prompts)}-{i}"
            if isinstance(p, str):
                self.add_request(rid, prompt=p, sampling=sp)
            else:
                self.add_request(rid, prompt_token_ids=list(p), sampling=sp)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                acc = results.get(o.request_id)
                results[o.request_id] = o if acc is None else merge_outputs(acc, o)
        return [results[r] for r in ids]

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
