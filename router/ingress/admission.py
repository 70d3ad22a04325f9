"""Admission at the ingress: who is calling (API key -> tenant), may they (size limits, in-flight
limits, rate limits), and what their request carries to the engines (RequestContext).

Every check runs locally and answers in microseconds, except a rate limit whose local credit has
run out: then one call to the quota actor (shared by all ingress replicas) takes the next slice
of the tenant's budget (`lease` of a minute's worth, at least what this request needs). So a
tenant's rate holds across ingress replicas, and the actor sees one call per slice, not one per
request. Refusals are ServingErrors with a gRPC code and, for overload, a retry-after.

The plain classes (TokenBucket, Quotas, IdempotencyStore) have injected clocks and no Ray; the
actor in router/actor.py is a thin shell over Quotas + IdempotencyStore.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from cluster.config import AppConfig, TenantOptions
from cluster.errors import InvalidRequestError
from cluster.engine.request import Priority, RequestContext
from router.ingress.status import Code, Rejected, ServingError

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


class TokenBucket:
    """`per_min` tokens a minute, refilled continuously; holds at most one minute's worth."""

    def __init__(self, per_min: float, clock: Callable[[], float] = time.monotonic):
        self.capacity = per_min
        self.rate = per_min / 60.0
        self.clock = clock
        self.tokens = per_min
        self._t = clock()

    def take(self, need: float, want: float) -> tuple[float, float]:
        """Take between `need` and `want` tokens: (granted, 0), or (0, seconds until `need` is there)."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._t) * self.rate)
        self._t = now
        if self.tokens + 1e-9 < need:
            return 0.0, (need - self.tokens) / self.rate
        granted = min(self.tokens, max(need, want))
        self.tokens -= granted
        return granted, 0.0


class Quotas:
    """The cluster-wide token buckets, one per (tenant, kind); what the quota actor holds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def take(self, tenant: str, kind: str, per_min: float, need: float, want: float) -> tuple[float, float]:
        bucket = self._buckets.get((tenant, kind))
        if bucket is None or bucket.capacity != per_min:  # first use, or the quota was reconfigured
            bucket = self._buckets[(tenant, kind)] = TokenBucket(per_min, self.clock)
        return bucket.take(need, want)


@dataclass
class _Record:
    fingerprint: str
    expires: float
    result: object = None
    done: bool = False


class IdempotencyStore:
    """Results of non-streaming requests by (tenant, key), kept for a TTL. The first request with
    a key runs; a duplicate gets the stored result, or waits for the running one (`begin` says which).
    A failed run forgets its key, so a retry runs again."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: dict[tuple[str, str], _Record] = {}

    def begin(self, tenant: str, key: str, fingerprint: str) -> tuple[str, object]:
        """("run", None): execute it; ("done", result); ("running", None): wait and ask again;
        ("conflict", None): the key was used with a different request."""
        self._expire()
        rec = self._records.get((tenant, key))
        if rec is not None and rec.fingerprint != fingerprint:
            return "conflict", None
        if rec is None:
            self._records[(tenant, key)] = _Record(fingerprint, self.clock() + self.ttl_s)
            return "run", None
        return ("done", rec.result) if rec.done else ("running", None)

    def finish(self, tenant: str, key: str, result: object) -> None:
        rec = self._records.get((tenant, key))
        if rec is not None:
            rec.result, rec.done, rec.expires = result, True, self.clock() + self.ttl_s

    def abandon(self, tenant: str, key: str) -> None:
        self._records.pop((tenant, key), None)

    def _expire(self) -> None:
        now = self.clock()
        for k in [k for k, r in self._records.items() if r.expires <= now]:
            del self._records[k]


@dataclass
class Ticket:
    """One admitted request: its context for the engines, and what to give back when it ends."""

    tenant: str
    ctx: RequestContext
    charged_output_tokens: int = 0
    _admission: "Admission | None" = field(default=None, repr=False)

    def done(self, completion_tokens: int = 0) -> None:
        """Release its in-flight slot and refund the output tokens it did not use. Idempotent."""
        if self._admission is not None:
            self._admission._release(self, completion_tokens)
            self._admission = None


TakeFn = Callable[[str, str, float, float, float], Awaitable[tuple[float, float]]]


class Admission:
    """One ingress replica's admission control. `take` reaches the shared buckets: the quota
    actor's `take` (or a local Quotas in tests), async, same arguments as Quotas.take."""

    def __init__(self, config: AppConfig, take: TakeFn):
        self.config = config
        self._take = take
        self._keys: list[tuple[str, str]] = [(k, DEFAULT_TENANT) for k in config.api_keys]
        for name, t in config.tenants.items():
            self._keys += [(k, name) for k in t.api_keys]
        self.auth_enabled = bool(self._keys)
        self._options = dict(config.tenants)
        self._options.setdefault(DEFAULT_TENANT, None)
        self._credits: dict[tuple[str, str], float] = {}
        self._inflight: dict[str, int] = {}
        self.total_inflight = 0

    # ---- who --------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant. Unknown or missing key -> UNAUTHENTICATED (auth off: 'default')."""
        if not self.auth_enabled:
            return DEFAULT_TENANT
        value = (authorization or "").strip()
        key = value[len("Bearer "):].strip() if value.lower().startswith("bearer ") else ""
        tenant = None
        for k, name in self._keys:  # compare every key: the time taken does not say which matched
            if key and hmac.compare_digest(key, k):
                tenant = name
        if tenant is None:
            raise ServingError(Code.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")
        return tenant

    # ---- may they ---------------------------------------------------------------------------

    async def admit(self, tenant: str, num_prompt_tokens: int, max_tokens: int,
                    deadline: float | None = None) -> Ticket:
        opts = self._options.get(tenant)
        self._check_size(tenant, opts, num_prompt_tokens, max_tokens)
        cap = self.config.admission.max_inflight
        if self.total_inflight >= cap:
            raise Rejected(f"the server is at capacity ({cap} requests in flight on this ingress)", 1.0,
                           reason="capacity")
        if opts is not None and opts.max_concurrent is not None:
            share = math.ceil(opts.max_concurrent / self.config.ingress_replicas)
            if self._inflight.get(tenant, 0) >= share:
                raise Rejected(f"tenant {tenant!r} has {share} requests in flight (max_concurrent "
                               f"{opts.max_concurrent})", 1.0, reason="concurrency")
        tokens = num_prompt_tokens + max_tokens
        if opts is not None:
            if opts.requests_per_min is not None:
                await self._spend(tenant, "requests", opts.requests_per_min, 1)
            if opts.tokens_per_min is not None:
                await self._spend(tenant, "tokens", opts.tokens_per_min, tokens)
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        self.total_inflight += 1
        charged = max_tokens if opts is not None and opts.tokens_per_min is not None else 0
        return Ticket(tenant, self.context(tenant, deadline), charged, self)

    def context(self, tenant: str, deadline: float | None = None) -> RequestContext:
        opts = self._options.get(tenant)
        if opts is None:
            return RequestContext(tenant=tenant, deadline=deadline)
        salt = (opts.cache_group if opts.cache_group is not None else tenant) if self.config.tenant_cache_isolation else ""
        return RequestContext(tenant=tenant, priority=Priority[opts.priority.upper()], weight=opts.weight,
                              kv_budget=opts.kv_budget, cache_salt=salt, deadline=deadline)

    def _check_size(self, tenant: str, opts: TenantOptions | None, n_prompt: int, max_tokens: int) -> None:
        if opts is None:
            return
        if opts.max_output_tokens is not None and max_tokens > opts.max_output_tokens:
            raise InvalidRequestError("max_tokens", f"{max_tokens} exceeds the max_output_tokens "
                                                    f"{opts.max_output_tokens} of tenant {tenant!r}")
        if opts.max_context is not None and n_prompt + max_tokens > opts.max_context:
            raise InvalidRequestError("max_tokens", f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                                                    f"the max_context {opts.max_context} of tenant {tenant!r}")
        if opts.tokens_per_min is not None and n_prompt + max_tokens > opts.tokens_per_min:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens = {n_prompt + max_tokens} exceeds the "
                                                    f"tokens_per_min {opts.tokens_per_min:g} of tenant {tenant!r}")

    async def _spend(self, tenant: str, kind: str, per_min: float, n: float) -> None:
        key = (tenant, kind)
        have = self._credits.get(key, 0.0)
        if have + 1e-9 >= n:  # the fast path: no remote call
            self._credits[key] = have - n
            return
        # Use up the local credit now, so requests admitted while we wait cannot spend it too.
        self._credits[key] = 0.0
        need = n - have
        try:
            granted, retry_after = await self._take(
                tenant, kind, per_min, need, need + self.config.admission.rate_limit_lease * per_min)
        except Exception as e:  # noqa: BLE001 — the quota actor is down: fail open, keep serving
            log.warning("quota actor unavailable (%s); admitting a request of %s", e, tenant)
            return
        if granted <= 0:
            self._credits[key] += have
            raise Rejected(f"tenant {tenant!r} is over its {kind}_per_min quota ({per_min:g})", retry_after,
                           reason=f"{kind}_per_min")
        self._credits[key] += granted - need

    def _release(self, ticket: Ticket, completion_tokens: int) -> None:
        self._inflight[ticket.tenant] -= 1
        self.total_inflight -= 1
        unused = ticket.charged_output_tokens - completion_tokens
        if unused > 0:
            key = (ticket.tenant, "tokens")
            self._credits[key] = self._credits.get(key, 0.0) + unused


class Idempotent:
    """Runs a non-streaming request at most once per (tenant, key) within the TTL, across ingress
    replicas, through the admission actor's IdempotencyStore."""

    def __init__(self, actor, wait_s: float = 300.0):
        self.actor = actor
        self.wait_s = wait_s

    async def run(self, tenant: str, key: str, fingerprint: str, execute: Callable[[], Awaitable[object]],
                  succeeded: Callable[[object], bool]) -> object:
        deadline = time.monotonic() + self.wait_s
        while True:
            state, result = await self.actor.begin.remote(tenant, key, fingerprint)
            if state == "done":
                return result
            if state == "conflict":
                raise ServingError(Code.FAILED_PRECONDITION,
                                   f"Idempotency-Key {key!r} was already used with a different request")
            if state == "running":
                if time.monotonic() >= deadline:
                    raise ServingError(Code.ABORTED, f"the request with Idempotency-Key {key!r} is still running")
                await self.actor.wait.remote(tenant, key, deadline - time.monotonic())
                continue
            try:
                result = await execute()
            except BaseException:
                await self.actor.abandon.remote(tenant, key)
                raise
            if succeeded(result):
                await self.actor.finish.remote(tenant, key, result)
            else:  # an error is not stored: the client may retry with the same key
                await self.actor.abandon.remote(tenant, key)
            return result
