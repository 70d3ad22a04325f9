"""Admission at the ingress: who is calling (API key -> tenant), may they (size limits, in-flight
limits, rate limits), and what their request carries to the engines (RequestContext).

Every check runs locally and answers in microseconds, except a rate limit whose local credit has
run out: then one call to the quota actor (shared by all ingress replicas) takes the next slice
of the tenant's budget (`lease` of a minute's worth, at least what this request needs). A refusal
from the actor carries when the bucket refills; until then the ingress refuses that tenant's
requests needing as much itself, so a flood against a quota costs one actor call per refill. A
tenant's rate holds across ingress replicas, and the actor sees one call per slice, not one per
request. Refusals are ServingErrors with a gRPC code and, for overload, a retry-after.

The plain classes (TokenBucket, Quotas) have injected clocks and no Ray; the quota actor
(gateway/admission_actor.py) is a thin shell over Quotas and the IdempotencyStore
(gateway/idempotency.py). Two gateway stages apply it: AdmissionStage (slots) and QuotaStage.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from cluster.config import AppConfig, KeySources, TenantOptions
from cluster.errors import InvalidRequestError
from cluster.engine.request import Priority, RequestContext
from router.ingress.gateway.capacity import InflightCap
from router.ingress.gateway.stages import Outcome, Stage
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


def key_digest(key: str) -> bytes:
    """What the ingress keeps of a key. Any string hashes (a non-ASCII or lone-surrogate key
    simply matches nothing)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_keys(source: KeySources, environ=os.environ) -> list[str]:
    """A tenant's keys from all its sources. A named variable or file that is missing, or that
    holds no key (empty, blank, comments only), is an error: a server that silently started with
    no keys would be open."""
    keys = [k for k in source.api_keys if k]
    if source.api_keys_env is not None:
        if source.api_keys_env not in environ:
            raise ValueError(f"api_keys_env: the environment variable {source.api_keys_env!r} is not set")
        found = [k.strip() for k in environ[source.api_keys_env].replace(",", "\n").splitlines() if k.strip()]
        if not found:
            raise ValueError(f"api_keys_env: the environment variable {source.api_keys_env!r} holds no key")
        keys += found
    if source.api_keys_file is not None:
        lines = Path(source.api_keys_file).read_text().splitlines()
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"api_keys_file: {source.api_keys_file!r} holds no key (one a line; # comments)")
        keys += found
    return keys


def load_key_digests(config: AppConfig, environ=os.environ) -> dict[bytes, str]:
    """SHA-256 of every configured key -> its tenant ('default' for the flat keys)."""
    digests: dict[bytes, str] = {}
    for name, source in [(DEFAULT_TENANT, config.default_keys), *config.tenants.items()]:
        for key in read_keys(source, environ):
            d = key_digest(key)
            if digests.get(d, name) != name:
                raise ValueError(f"an API key of tenant {name!r} is also a key of tenant {digests[d]!r}")
            digests[d] = name
    return digests


class Admission:
    """One ingress replica's admission control. `take` reaches the shared buckets: the quota
    actor's `take` (or a local Quotas in tests), async, same arguments as Quotas.take."""

    def __init__(self, config: AppConfig, take: TakeFn, key_digests: dict[bytes, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._take = take
        # Only the keys' SHA-256 stays in memory (load_key_digests reads env and files).
        self._keys = list((key_digests if key_digests is not None else load_key_digests(config)).items())
        self.auth_enabled = bool(self._keys)
        self._options = dict(config.tenants)
        self._options.setdefault(DEFAULT_TENANT, None)
        self._credits: dict[tuple[str, str], float] = {}
        # (monotonic time, need): the shared bucket refused `need` until then
        self._refused_until: dict[tuple[str, str], tuple[float, float]] = {}
        self._inflight: dict[str, int] = {}
        self.total_inflight = 0
        self.max_inflight = InflightCap(config.admission.max_inflight, config.ingress_replicas)

    # ---- who --------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant. Unknown or missing key -> UNAUTHENTICATED (auth off: 'default')."""
        if not self.auth_enabled:
            return DEFAULT_TENANT
        cap = self.config.ingress_limits.max_authorization_chars
        if authorization is not None and len(authorization) > cap:
            raise ServingError(Code.UNAUTHENTICATED, f"authorization: longer than {cap} characters")
        value = (authorization or "").strip()
        key = value[len("Bearer "):].strip() if value.lower().startswith("bearer ") else ""
        digest = key_digest(key)
        tenant = None
        for d, name in self._keys:  # compare every key: the time taken does not say which matched
            if key and hmac.compare_digest(digest, d):
                tenant = name
        if tenant is None:
            raise ServingError(Code.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")
        return tenant

    # ---- may they ---------------------------------------------------------------------------

    # A request's admission is three steps, so no work is done for a request that may not run:
    #   reserve (sync: its in-flight slot is taken before any await, so N concurrent callers can
    #   never all pass a check of the same count) -> start (requests_per_min) -> [tokenize] ->
    #   charge (size limits, tokens_per_min). The caller releases the ticket on any refusal.

    def reserve(self, tenant: str, deadline: float | None = None) -> Ticket:
        """Take an in-flight slot (per ingress, and the tenant's share of max_concurrent) or refuse."""
        opts = self._options.get(tenant)
        cap = self.max_inflight()
        batch = opts is not None and opts.priority == "batch"
        if batch:
            cap = max(1, int(cap * self.config.admission.batch_share))  # batch work is shed first
        if self.total_inflight >= cap:
            raise Rejected(f"the server is at capacity ({cap} requests in flight on this ingress"
                           f"{' for batch work' if batch else ''})", 1.0, reason="capacity")
        if opts is not None and opts.max_concurrent is not None:
            share = math.ceil(opts.max_concurrent / self.config.ingress_replicas)
            if self._inflight.get(tenant, 0) >= share:
                raise Rejected(f"tenant {tenant!r} has {share} requests in flight (max_concurrent "
                               f"{opts.max_concurrent})", 1.0, reason="concurrency")
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        self.total_inflight += 1
        return Ticket(tenant, self.context(tenant, deadline), 0, self)

    async def start(self, ticket: Ticket) -> None:
        """The per-request rate limit (requests_per_min): local credit, else one actor call."""
        opts = self._options.get(ticket.tenant)
        if opts is not None and opts.requests_per_min is not None:
            await self._spend(ticket.tenant, "requests", opts.requests_per_min, 1)

    async def charge(self, ticket: Ticket, num_prompt_tokens: int, max_tokens: int) -> None:
        """The size limits and tokens_per_min, once the prompt's length is known."""
        opts = self._options.get(ticket.tenant)
        self._check_size(ticket.tenant, opts, num_prompt_tokens, max_tokens)
        if opts is not None and opts.tokens_per_min is not None:
            await self._spend(ticket.tenant, "tokens", opts.tokens_per_min, num_prompt_tokens + max_tokens)
            ticket.charged_output_tokens = max_tokens

    async def admit(self, tenant: str, num_prompt_tokens: int, max_tokens: int,
                    deadline: float | None = None) -> Ticket:
        """All three steps at once (a request whose length is already known)."""
        ticket = self.reserve(tenant, deadline)
        try:
            await self.start(ticket)
            await self.charge(ticket, num_prompt_tokens, max_tokens)
        except BaseException:
            ticket.done()
            raise
        return ticket

    def inflight_by_tenant(self) -> dict[str, int]:
        return dict(self._inflight)

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
        refused = self._refused_until.get(key)
        if refused is not None:  # the shared bucket said when it holds `need` again: until then, ask it
            until, refused_need = refused  # for as much or more, and it can only say no: refuse here
            left = until - self.clock()
            if left <= 0:
                del self._refused_until[key]
            elif n - have >= refused_need - 1e-9:
                raise Rejected(f"tenant {tenant!r} is over its {kind}_per_min quota ({per_min:g})", left,
                               reason=f"{kind}_per_min")
        # Use up the local credit now, so requests admitted while we wait cannot spend it too.
        self._credits[key] = 0.0
        need = n - have
        try:
            granted, retry_after = await asyncio.wait_for(self._take(
                tenant, kind, per_min, need, need + self.config.admission.rate_limit_lease * per_min),
                self.config.admission.actor_timeout_s)
        except Exception as e:  # noqa: BLE001 — quota actor down or slow: fail open, keep serving
            log.warning("quota actor unavailable (%r); admitting a request of %s", e, tenant)
            return
        if granted <= 0:
            self._credits[key] += have
            # no other ingress can take it sooner: a flood against the quota costs no more actor calls
            self._refused_until[key] = (self.clock() + retry_after, need)
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


class AdmissionStage(Stage):
    """An in-flight slot (this ingress's, and the tenant's share of max_concurrent), taken before
    any await so N concurrent callers can never all pass a check of the same count, and the
    RequestContext both engines schedule the request by. With max_inflight "auto", the decode
    pool's KV is read in the background when due, and each admitted request's size measured."""

    def __init__(self, admission: Admission, read_timeout_s: float = 2.0):
        self.admission = admission
        self.read_timeout_s = read_timeout_s
        self._background: set[asyncio.Task] = set()  # reads off the request path (kept referenced)

    async def admit(self, o: Outcome) -> None:
        if self.admission.max_inflight.due():
            self._read_decode_kv(o.flow)
        o.ticket = self.admission.reserve(o.tenant, o.request.deadline)
        o.ctx = o.ticket.ctx

    async def charge(self, o: Outcome) -> None:
        self.admission.max_inflight.admitted(o.prepared.num_prompt_tokens + o.sampling.max_tokens)

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.ticket is not None:
            o.ticket.done(o.completion_tokens)

    def _read_decode_kv(self, flow) -> None:
        """The decode pool's KV tokens for the auto cap (gateway/capacity.py InflightCap); a
        failed read keeps the last one."""
        cap = self.admission.max_inflight
        cap.kv_read(None)  # not due again for REFRESH_S, whatever the read does

        async def read():
            cap.kv_read(await flow.decode_kv_tokens(self.read_timeout_s))

        self._background.add(task := asyncio.ensure_future(read()))
        task.add_done_callback(self._background.discard)


class QuotaStage(Stage):
    """The tenant's rates: requests_per_min before the prompt is tokenized, its size limits and
    tokens_per_min once its length is known (unused output tokens are refunded with the slot)."""

    def __init__(self, admission: Admission):
        self.admission = admission

    async def admit(self, o: Outcome) -> None:
        await self.admission.start(o.ticket)

    async def charge(self, o: Outcome) -> None:
        await self.admission.charge(o.ticket, o.prepared.num_prompt_tokens, o.sampling.max_tokens)
