"""The synchronous engine: validate, schedule, run, sample; its OutputProcessor detokenizes.

    out = scheduler.schedule()
    sampled = runner.execute(out.chunks, block_tables, while_running)
    finished = scheduler.update(out, sampled.tokens)  # sampled.failed: ended alone first
    outputs = output_processor.process(out.chunks, sampled, before)  # stop strings end requests here

Async output (`async_output`, on with CUDA): a decode-only step's outputs that cannot change a
request's state are deferred, and emitted by the next step from `while_running`, i.e. while that
step's forward runs on the device (vLLM v0's async output processing). Whatever ends a request first
emits its deferred output (abort, fail, expiry), so each request's stream is unchanged.

Not thread-safe: EngineLoop drives it from one thread.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from cluster.engine.attention import resolve_backend
from cluster.engine.config import EngineConfig, cache_dtype, kv_block_bytes, run_dtype
from cluster.engine.engine_build import load_weights, log_ready, make_speculator
from cluster.engine.engine_roles import DecodeVerbs, PrefillVerbs
from cluster.engine.engine_state import EngineState
from cluster.engine.grammar import Grammars
from cluster.engine.kv_cache import KVCacheManager, TierLoader, extend_salt
from cluster.engine.model.hub import resolve_checkpoint
from cluster.engine.model.identity import model_identity
from cluster.engine.model_config import ModelConfig
from cluster.engine.model_runner import ModelRunner
from cluster.engine.output_processor import Deferred, OutputProcessor
from cluster.engine.outputs import EngineStats, RequestOutput, merge_outputs
from cluster.engine.probe import EngineProbe
from cluster.engine.request import DEFAULT_CONTEXT, Request, RequestContext, RequestStatus
from cluster.engine.sampler import RequestFailure, SamplerOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.static_decode import StaticDecode
from cluster.engine.tier_arenas import build_tiers
from cluster.engine.validation import RequestValidator
from cluster.errors import ErrorKind

log = logging.getLogger(__name__)

LOAD_WAIT_S = 0.005  # an engine with only tier copies in flight waits this long for one (no spin)
# A tier copy expected to take at most this fraction of a step runs at admission, on the engine's
# thread, and its request computes in the same step; a longer one goes to the loader thread and
# its request computes a step later. At 1.0 the choice is the request's: a copy shorter than the
# step it would otherwise wait for is cheaper done now (the others wait no longer than a prompt
# chunk makes them); a longer one would stall every running request for more than a step.
INLINE_LOAD_STEP_FRACTION = 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine(PrefillVerbs, DecodeVerbs, EngineState):
    def __init__(self, config: EngineConfig):
        self.config = config = config.model_copy(update={"model": resolve_checkpoint(config.model)})  # Hub id: snapshot
        self.model_config = mc = ModelConfig.from_dir(config.model)
        self.device = resolve_device(config.device)
        self.dtype = dtype = getattr(torch, run_dtype(mc, config))
        kv_dtype = getattr(torch, cache_dtype(mc, config))
        self.validator = RequestValidator.for_model(config.model, [config])
        self.tokenizer = self.validator.tokenizer
        self.max_model_len = self.validator.max_model_len
        self.block_size = config.block_size
        # One block of all layers is one contiguous region (config.kv_block_shape).
        self.block_bytes = kv_block_bytes(mc, config)
        num_blocks = self.validator.num_blocks
        w = load_weights(config, mc, num_blocks, self.max_model_len, dtype, kv_dtype, self.device, self.tokenizer)
        self.tensor_parallel, self.model, self.kv_cache = w.tensor_parallel, w.model, w.kv_cache
        self.model_identity = model_identity(config.model, mc)  # architecture + weights: the KV's identity
        salt = extend_salt(self.model_identity.encode(), config.cache_salt)
        tiers = config.kv_tiers
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, salt,
                                 build_tiers(config.kv_tiers, self.kv_cache, self.block_bytes),
                                 TierLoader(threaded=tiers.enabled and tiers.async_loads), tiers.store_threshold)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   config.max_waiting, config.queue_ttl_s)
        torch_path = w.static or kv_dtype != dtype  # a quantized pool is read by the torch backend only
        backend = resolve_backend("torch" if torch_path and config.attention_backend == "auto"
                                  else config.attention_backend,
                                  self.device, config.block_size, dtype)
        self.eos_token_ids = self.validator.eos_token_ids
        grammars = Grammars(self.tokenizer.to_json(), max(mc.vocab_size, self.tokenizer.vocab_size),
                            tuple(t for t in self.eos_token_ids if t < self.tokenizer.vocab_size))
        static_decode = StaticDecode.for_engine(self.model, w.pool, config, self.max_model_len, self.device, w.static)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, config.block_size, self.device, config.seed,
                                  grammars, static_decode)
        self.scheduler.on_free = self._on_free
        self.stats = EngineStats()
        self._save_failures_seen = 0  # the tiers' failed saves already counted as step errors
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.stats, self._finished)
        self.async_output = config.async_output == "on" or (config.async_output == "auto" and self.device.type == "cuda")
        self._deferred: list[Deferred] = []  # the last decode-only step's outputs, not emitted yet
        self.speculator = make_speculator(config, mc, num_blocks, self.max_model_len, dtype, self.device, backend,
                                          w.ops, self.stats)
        self.probe: EngineProbe | None = None  # set by a replica with telemetry on (plain Python, no Ray)
        log_ready(self)

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

    def add(self, req: Request, hold_kv: bool = False) -> None:
        """Queue a request. With `hold_kv` its blocks outlive a normal finish, held until
        `release()` (prefill: decode pulls them)."""
        req.keep_kv = hold_kv
        self.scheduler.add(req)
        self.stats.requests_received += 1
        self.output_processor.add(req, req.prompt_token_ids)

    def add_request(self, request_id: str, prompt=None, prompt_token_ids=None, sampling=None) -> Request:
        req = self.make_request(request_id, prompt, prompt_token_ids, sampling)
        self.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        pending = self._settle(request_id)
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        return None if req is None else self._final(req, pending)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._deferred)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with an error, freeing its blocks; its terminal output, if it was here."""
        pending = self._settle(request_id)
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        if req is None:
            return None
        req.error = error
        return self._final(req, pending)

    def _final(self, req: Request, pending: RequestOutput | None) -> RequestOutput:
        """A request's terminal output, after its deferred output if it had one (one output)."""
        final = self.output_processor.final_output(req, [], "")
        return final if pending is None else merge_outputs(pending, final)

    def _settle(self, request_id: str) -> RequestOutput | None:
        """The request's deferred output, emitted now (before something ends it)."""
        for i, item in enumerate(self._deferred):
            if item[0].request_id == request_id:
                del self._deferred[i]
                return self.output_processor.emit([item])[0]
        return None

    def _emit_deferred(self) -> list[RequestOutput]:
        deferred, self._deferred = self._deferred, []
        return self.output_processor.emit(deferred) if deferred else []

    def _on_free(self, request_id: str) -> None:
        """The scheduler's on_free: a request's blocks went (it ended, or was preempted)."""
        self.runner.release_static(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: expire, schedule, execute, update, outputs. Returns the outputs of the
        requests it ended or moved on: the expired first, then the failed, then the step's."""
        outputs = self._expire()
        out = self._schedule()
        saves_failed = self._saves_failed()
        if out.is_empty:
            if self.kv.num_loading:  # only tier copies in flight: wait for one, do not spin
                self.kv.wait_loads(LOAD_WAIT_S)
            return outputs + self._emit_deferred()
        t0 = time.perf_counter()
        tables = {c.request.request_id: self.kv.block_ids(c.request.request_id) for c in out.chunks}
        emitted: list[RequestOutput] = []
        try:
            sampled = self.runner.execute(out.chunks, tables,
                                          (lambda: emitted.extend(self._emit_deferred())) if self._deferred else None)
        except Exception as e:  # a broken step fails its requests, never the loop
            return outputs + emitted + self._emit_deferred() + self._step_failed(out, e)
        outputs += emitted + self._emit_deferred()  # (none left when the runner called back)
        # Requests whose own numbers failed end alone, before update(), which then skips them.
        outputs += self._fail(sampled.failed)
        before = self._update(out, sampled)
        self._count_step(out, t0, clean=not saves_failed)
        defer = self._deferred if self.async_output and _decode_only(out) else None
        return outputs + self.output_processor.process(out.chunks, sampled, before, defer)

    def _expire(self) -> list[RequestOutput]:
        expired = self.scheduler.expire(time.time(), self.scheduler.clock())
        return [self._final(r, self._settle(r.request_id) if self._deferred else None) for r in expired]

    def _schedule(self) -> SchedulerOutput:
        if self.speculator is not None:  # drafts first: the scheduler budgets their tokens
            self.speculator.propose(self.scheduler.running)
        # the step a copy would stall: a decode step's while requests decode (their inter-token gap)
        self.kv.inline_load_s = INLINE_LOAD_STEP_FRACTION * (self.stats.decode_step_s_avg or self.stats.step_s_avg)
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        return out

    def _step_failed(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """The forward raised: all the step's requests fail (counted: the replica's health reads
        the failures in a row). Called while `e` is handled, so its traceback is logged."""
        log.exception("engine step failed")
        self.count_step_error()
        failure = RequestFailure(ErrorKind.FORWARD, f"engine step failed: {type(e).__name__}: {e}")
        return self._fail({c.request.request_id: failure for c in out.chunks})

    def count_step_error(self) -> None:
        """A step that failed, in whole or in part: the replica's health reads the failures in a row."""
        self.stats.step_errors += 1
        self.stats.consecutive_step_errors += 1
        self.stats.last_step_error_at = time.monotonic()

    def _saves_failed(self) -> bool:
        """Did a KV tier fail to save a block since the last step (while scheduling, or between
        steps: a role's lease or import)? The save was skipped, no request failed for it, but the
        step counts as a step error, so a tier that keeps failing (a full disk) trips health."""
        failures = self.kv.save_failures
        if failures == self._save_failures_seen:
            return False
        self._save_failures_seen = failures
        self.count_step_error()
        return True

    def _update(self, out: SchedulerOutput, sampled: SamplerOutput) -> dict[str, int]:
        """Append the step's tokens (ending the requests they end). Returns each sampling
        request's number of output tokens before them: the output processor emits from there."""
        before = {c.request.request_id: c.request.num_output_tokens for c in out.chunks if c.samples}
        self.scheduler.update(out, sampled.tokens, sampled.accepted)
        if self.speculator is not None:
            self.speculator.observe(out, sampled.accepted)
        return before

    def _count_step(self, out: SchedulerOutput, t0: float, clean: bool) -> None:
        """A step that ran: the counters, its time (the speculator's cost model measures it too)
        and the probe. A clean one (no failed tier save) ends a run of step errors."""
        st = self.stats
        st.steps += 1
        if clean:
            st.consecutive_step_errors = 0
        st.last_step_s = time.perf_counter() - t0
        st.busy_s += st.last_step_s
        self._time_step(out, st.last_step_s)
        if self.speculator is not None:
            self.speculator.observe_step(out, st.last_step_s)
        if self.probe is not None:
            self.probe.step(out, time.monotonic(), st.last_step_s)
        st.tokens_computed += out.num_tokens

    def _time_step(self, out: SchedulerOutput, seconds: float) -> None:
        st = self.stats
        st.step_s_avg = _smooth(st.step_s_avg, seconds)
        if all(c.num_tokens == 1 + len(c.draft) and c.start >= c.request.num_prompt_tokens for c in out.chunks):
            st.decode_steps += 1
            st.decode_step_s_avg = _smooth(st.decode_step_s_avg, seconds)
        else:
            st.prompt_steps += 1
            st.prompt_s_per_token_avg = _smooth(st.prompt_s_per_token_avg, seconds / out.num_tokens)

    def _fail(self, failures: dict[str, RequestFailure]) -> list[RequestOutput]:
        """End these requests with finish reason "error" (blocks freed); their terminal outputs."""
        outputs = []
        for rid, failure in failures.items():
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            if req is None:
                continue
            log.warning("request %s failed (%s): %s", rid, failure.kind.value, failure.reason)
            req.error, req.error_kind = failure.reason, failure.kind
            outputs.append(self.output_processor.final_output(req, [], ""))
        return outputs

    def _finished(self, req: Request) -> None:
        """The output processor's `on_finish`: every way a request ends makes its terminal output
        there, so this is the one place its sampler state goes and its end is counted."""
        self.runner.sampler.release(req.request_id)
        reason = req.status.finish_reason
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1
        if self.probe is not None:
            self.probe.finished(req)

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


def _decode_only(out: SchedulerOutput) -> bool:
    """Every chunk one plain decode token past its prompt (a first token is never deferred):
    the steps whose outputs async output defers."""
    return all(c.num_tokens == 1 and c.samples and not c.draft and c.start >= c.request.num_prompt_tokens
               for c in out.chunks)


def _smooth(avg: float, value: float) -> float:
    """An EWMA over about ten values (the first value starts it)."""
    return value if avg == 0 else 0.9 * avg + 0.1 * value
