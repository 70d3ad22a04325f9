"""A step's sampled tokens -> the RequestOutputs the engine returns (as vLLM v1's OutputProcessor).

Each request's incremental detokenizer lives here, from its admission to its terminal output, so
stop strings are applied here, where the text is. A stop string ends its request at the token that
completed it: a speculative step's tokens after that one are dropped from the request, never
emitted. Every terminal output is made here too, and tells the engine (`on_finish`) first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from cluster.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from cluster.engine.request import Request, RequestStatus
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.errors import ErrorKind

if TYPE_CHECKING:
    from cluster.engine.sampler import SamplerOutput
    from cluster.engine.scheduler import ScheduledChunk, Scheduler


Deferred = tuple[Request, list[int], TokenLogprob | None]  # a step's new tokens of a request, not yet emitted


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, stats: EngineStats,
                 on_finish: Callable[[Request], None]):
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # a stop string ends its request there
        self.stats = stats
        self.on_finish = on_finish
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request, token_ids: Sequence[int]) -> None:
        """Detokenize the request's output from after `token_ids`: its prompt, then any output
        tokens already sent from elsewhere (prefill's first token, a migrated request's)."""
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, req.sampling.stop)

    def process(self, chunks: Sequence[ScheduledChunk], sampled: SamplerOutput,
                before: dict[str, int], defer: list[Deferred] | None = None) -> list[RequestOutput]:
        """The step's output of each request it sampled, in chunk order. `before`: each sampling
        request's number of output tokens before the step (its new ones start there). With
        `defer`, the outputs that cannot change a request's state (it did not finish, and has no
        stop string for its text to match) are appended there instead, for `emit` later."""
        outputs = []
        tokens_of, logprobs = sampled.tokens, sampled.logprobs
        for c in chunks:
            req = c.request
            rid = req.request_id
            if rid not in tokens_of:  # nothing to sample yet, or failed
                continue
            ids = req.output_token_ids
            if len(ids) == 1:  # its prompt is done: count what the cache saved once
                self.stats.cached_prompt_tokens += req.num_cached_tokens
            tokens = ids[before[rid]:]  # one, or a speculative step's several
            lp = logprobs.get(rid) if logprobs else None
            if defer is not None and not req.status.finished and not req.sampling.stop:
                defer.append((req, tokens, lp))
            else:
                outputs.append(self._output(req, tokens, lp))
        return outputs

    def emit(self, deferred: Sequence[Deferred]) -> list[RequestOutput]:
        """The deltas `process` deferred, in its order: what it would have made then (the
        request had not finished and has no stop string). Always deltas: a request that ended
        since (abort, error, deadline) gets its terminal output from its ender, after this."""
        outputs = []
        for req, tokens, lp in deferred:
            detok = self._detok[req.request_id]
            for token in tokens:
                detok.add(token)
            self.stats.generation_tokens += len(tokens)
            outputs.append(self._delta(req, tokens, detok.take(final=False), None if lp is None else [lp]))
        return outputs

    def _output(self, req: Request, tokens: list[int], lp: TokenLogprob | None) -> RequestOutput:
        detok = self._detok[req.request_id]
        if len(tokens) == 1:  # a decode's one token (_through_stop's loop, without the loop)
            detok.add(tokens[0])
        else:
            tokens = self._through_stop(req, detok, tokens)
        self.stats.generation_tokens += len(tokens)
        if detok.stopped and not req.status.finished:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        finished = req.status.finished
        text = detok.take(final=finished)
        out = (self.final_output if finished else self._delta)(req, tokens, text, None if lp is None else [lp])
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:  # the prompt is done: once
            out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return out

    def _through_stop(self, req: Request, detok: IncrementalDetokenizer, tokens: list[int]) -> list[int]:
        """Detokenize the step's new tokens up to a stop string; the tokens after it are never
        emitted. Returns the tokens to emit."""
        for i, token in enumerate(tokens):
            detok.add(token)
            if detok.stopped:
                if i + 1 < len(tokens):
                    req.drop_last_tokens(len(tokens) - i - 1)
                    tokens = tokens[: i + 1]
                    if req.status.finished:  # by a later token: the stop string came first
                        req.status = RequestStatus.FINISHED_STOPPED
                break
        return tokens

    def _delta(self, req: Request, tokens: list[int], text: str, logprobs=None) -> RequestOutput:
        cached = req.num_cached_tokens
        return RequestOutput(
            req.request_id, tokens, text, False, None,
            len(req.prompt_token_ids), len(req.output_token_ids), cached if cached > 0 else 0, None, None, logprobs,
        )

    def final_output(self, req: Request, tokens: list[int], text: str,
                     logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """A finished request's terminal output, however it ended (its tokens, a stop, an abort,
        an error, its deadline): its detokenizer goes."""
        self._detok.pop(req.request_id, None)
        self.on_finish(req)
        kind = req.error_kind or (ErrorKind.INTERNAL if req.status == RequestStatus.FINISHED_ERROR else None)
        return RequestOutput(
            req.request_id, tokens, text, True, req.status.finish_reason,
            req.num_prompt_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0), req.error, kind, logprobs,
        )
