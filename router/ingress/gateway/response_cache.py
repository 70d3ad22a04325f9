"""The response cache: finished temperature-0 completions of the tenants that opt in, replayed
without touching the engines.

Per ingress replica, in memory: a short TTL, at most `max_entries` entries and `max_bytes` of
stored text, token ids and logprobs (least recently used go first; a completion larger than
`max_entry_bytes` is not stored). A redeploy (new model, new config) starts an empty cache.

The key is a SHA-256 over the model (served name and its identity: architecture fingerprint and
weights digest, the block-hash salt), the tenant (tenants never see each other's entries, nor
learn by a hit what another asked), the prompt's token ids, and every field of the
SamplingParams (max_tokens, stop strings and ids, penalties, logit_bias, logprobs, the response
format, seed...). What is cached and what is not:
  - temperature exactly 0 only (after the model's defaults are applied); other requests pass by;
  - n > 1 (HTTP) runs each choice as a request of its own (choice i with seed + i): each is
    cached and replayed on its own; usage marks a hit when every choice was one;
  - logprobs are stored with the tokens and replayed (the key includes how many were asked for);
  - only completions that ended with `stop` or `length`: an error, a cancel or a guardrail's
    `content_filter` is never stored, nor one a guardrail passed because a check failed open. What is stored is what the client got, after the tenant's
    guardrail, so a hit passed the same output checks;
  - concurrent identical misses each run (no coalescing); the last to finish is stored.
A hit is marked in usage (all prompt tokens cached, and the request's `Outcome.cache_hit`) and counted in
`pdserve_response_cache_requests{result}` (hit, miss, bypass: an opted-in tenant's request that is
not cacheable). A hit still goes through admission (rate and token quotas count it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

from cluster.config import AppConfig, ResponseCacheOptions
from cluster.engine.outputs import FinishReason
from cluster.engine.sampling_params import SamplingParams

from router.ingress.gateway.guardrails import Action
from router.ingress.gateway.stages import Outcome, Stage

if TYPE_CHECKING:
    from router.ingress.request import Delta

CACHED_FINISH = (FinishReason.STOP, FinishReason.LENGTH)
DELTA_OVERHEAD_BYTES = 64


def delta_bytes(d: "Delta") -> int:
    """What a stored delta holds: its text, token ids, logprobs, and the first delta's prompt
    logprobs and prompt token ids (an 8k-token prompt's are most of an entry)."""
    lp = sum(_logprob_bytes(x) for x in d.logprobs or ()) + sum(_logprob_bytes(x) for x in d.prompt_logprobs or ())
    ids = len(d.token_ids) + len(d.prompt_token_ids or ())
    return DELTA_OVERHEAD_BYTES + len(d.text.encode()) + 4 * ids + lp


def _logprob_bytes(lp) -> int:
    return 8 if lp is None else 16 + 16 * len(lp.top)


@dataclass
class _Entry:
    deltas: tuple
    nbytes: int
    expires: float


class ResponseCache:
    def __init__(self, options: ResponseCacheOptions, tenants: set[str], version: str,
                 clock: Callable[[], float] = time.monotonic, metrics=None):
        self.options = options
        self.tenants = tenants  # those that opted in
        self.version = version
        self.clock = clock
        self.metrics = metrics  # GuardrailMetrics (cluster/telemetry/metrics.py) or None
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0

    @classmethod
    def from_config(cls, config: AppConfig, identity: str, metrics=None) -> "ResponseCache":
        """`identity`: the model's (cluster/engine/model/identity.py: architecture + weights digest)."""
        tenants = {n for n, t in config.tenants.items() if t.response_cache}
        if config.response_cache.default_tenant:
            tenants.add("default")
        return cls(config.response_cache, tenants, f"{config.model_name}:{identity}", metrics=metrics)

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, tenant: str, ids: Sequence[int], sampling: SamplingParams) -> bytes | None:
        """None: not cacheable (the tenant did not opt in, or the request is not temperature 0)."""
        if tenant not in self.tenants:
            return None
        if sampling.temperature != 0:
            self._count(tenant, "bypass")
            return None
        blob = json.dumps([self.version, tenant, list(ids), asdict(sampling)], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).digest()

    def get(self, key: bytes) -> tuple | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= self.clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.deltas

    def put(self, key: bytes, deltas: Sequence["Delta"]) -> bool:
        nbytes = sum(delta_bytes(d) for d in deltas)
        if nbytes > min(self.options.max_entry_bytes, self.options.max_bytes):
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = _Entry(tuple(deltas), nbytes, self.clock() + self.options.ttl_s)
        self.nbytes += nbytes
        while len(self._entries) > self.options.max_entries or self.nbytes > self.options.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: bytes) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def _count(self, tenant: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.cache_requests.inc(1, {"tenant": tenant, "result": result})

    async def through(self, tenant: str, ids: Sequence[int], sampling: SamplingParams, label: str,
                      deltas: AsyncIterator["Delta"], hit: Callable[[], None] = lambda: None,
                      storable: Callable[[], bool] = lambda: True) -> AsyncIterator["Delta"]:
        """A hit: `hit()`, the stored deltas, relabelled, and `deltas` closed unstarted (no engine
        sees the request). A miss: `deltas` passed through, and stored when they end in stop/length
        and `storable()` still holds then (a guardrail that failed open passed them unchecked)."""
        key = self.key(tenant, ids, sampling)
        async with aclosing(deltas):
            stored = None if key is None else self.get(key)
            if stored is not None:
                self._count(tenant, "hit")
                hit()
                for d in stored:
                    yield replace(d, request_id=label, token_ids=list(d.token_ids), cached_prompt_tokens=d.prompt_tokens)
                return
            if key is not None:
                self._count(tenant, "miss")
            seen: list = []
            nbytes = 0
            async for d in deltas:
                if key is not None:
                    seen.append(replace(d, token_ids=list(d.token_ids)))
                    nbytes += delta_bytes(d)
                    if nbytes > self.options.max_entry_bytes:  # too large to store: stop collecting
                        key, seen = None, []
                yield d
            if key is not None and seen and seen[-1].finish_reason in CACHED_FINISH and storable():
                self.put(key, seen)


class ResponseCacheStage(Stage):
    """Replays a stored completion (the flow never starts), or stores the one that ran."""

    def __init__(self, cache: ResponseCache):
        self.cache = cache

    def wrap(self, o: Outcome, deltas: AsyncIterator["Delta"]) -> AsyncIterator["Delta"]:
        def hit() -> None:
            o.cache_hit = True

        def checked() -> bool:  # every check decided: nothing passed because a check failed open
            return not any(iv.action is Action.PASSED_ON_ERROR for iv in o.interventions)

        return self.cache.through(o.tenant, o.prepared.prompt_token_ids, o.sampling, o.label, deltas, hit, checked)
