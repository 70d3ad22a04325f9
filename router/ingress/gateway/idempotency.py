"""Idempotency-Key (HTTP): a non-streaming request runs at most once per (tenant, key) within a
TTL, across ingress replicas. `IdempotencyStore` is the plain, clocked store the admission actor
holds (gateway/admission_actor.py); `Idempotent` is one ingress's side of it.

A running record is owned by the ingress replica running it, which holds a lease on the store
(`lease_s`, renewed every lease_s / 3 while it runs anything under a key). An ingress that dies
stops renewing: within lease_s of its last renewal its running records are dropped (and their
waiters woken, one of them then runs the request), instead of blocking the key for the whole TTL.
The actor checks leases every lease_s / 3, so a dead ingress's keys are free again at most
4/3 lease_s (13.3 s) after its death. The cost: an ingress whose event loop stalls longer than
lease_s (it could not renew) loses its records as a dead one would, and a duplicate may then run
the request a second time; its late finish or abandon no longer touches the key."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from router.ingress.gateway.admission import Admission
from router.ingress.status import Code, Rejected, ServingError

log = logging.getLogger(__name__)


@dataclass
class _Record:
    fingerprint: str
    expires: float
    result: object = None
    done: bool = False
    waiters: int = 0
    owner: str | None = None  # the ingress running it (None: no lease, kept until the TTL)
    nbytes: int = 0  # its result's size (`result_bytes`), once done


LEASE_S = 10.0  # an ingress's lease on its running records (module docstring)
# Finished results a tenant may have kept: 1,024 keys of 64 KiB completions. The key bound alone let
# a tenant keep 1,024 results of any size (a long completion with logprobs is megabytes) in the
# one admission actor every ingress shares.
MAX_RESULT_BYTES = 64 * 2**20


def result_bytes(result: object) -> int:
    """A result's size as kept: its JSON (the OpenAI edge stores the response body's dict)."""
    return len(json.dumps(result, separators=(",", ":"), default=repr).encode())


class IdempotencyStore:
    """Results of non-streaming requests by (tenant, key), kept for a TTL. The first request with
    a key runs; a duplicate gets the stored result, or waits for the running one (`begin` says which).
    A failed run forgets its key, so a retry runs again.

    Bounded: at most `max_keys` records per tenant (the least recently used finished record makes
    room; a tenant whose records are all still running gets "full"), at most `max_bytes` of
    finished results per tenant (`result_bytes`; the least recently used finished results make
    room; a result larger than the bound alone is not kept, as an abandoned run is, and counted
    in `too_large`) and `max_waiters` duplicates waiting on one running key (`join` refuses the next)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 1024,
                 max_waiters: int = 8, lease_s: float = LEASE_S, max_bytes: int = MAX_RESULT_BYTES):
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_keys = max_keys
        self.max_waiters = max_waiters
        self.lease_s = lease_s
        self.max_bytes = max_bytes
        self.too_large = 0  # results not kept: larger than max_bytes
        self._tenants: dict[str, OrderedDict[str, _Record]] = {}  # per tenant, least recently used first
        self._bytes: dict[str, int] = {}  # per tenant, its finished results' result_bytes
        self._leases: dict[str, float] = {}  # owner -> when its lease lapses

    def begin(self, tenant: str, key: str, fingerprint: str, owner: str | None = None) -> tuple[str, object]:
        """("run", None): execute it (the record is `owner`'s, which holds a lease from now);
        ("done", result); ("running", None): wait and ask again; ("conflict", None): the key was
        used with a different request; ("full", None): the tenant has max_keys requests running
        under keys."""
        records = self._tenants.setdefault(tenant, OrderedDict())
        self._expire(tenant)
        rec = records.get(key)
        if rec is not None and rec.fingerprint != fingerprint:
            return "conflict", None
        if rec is None:
            if len(records) >= self.max_keys and not self._evict_one(tenant):
                return "full", None
            records[key] = _Record(fingerprint, self.clock() + self.ttl_s, owner=owner)
            if owner is not None:
                self.renew(owner)
            return "run", None
        records.move_to_end(key)
        return ("done", rec.result) if rec.done else ("running", None)

    def finish(self, tenant: str, key: str, result: object, owner: str | None = None) -> bool:
        """Store the result of `owner`'s run (room made by the tenant's least recently used
        results; one over max_bytes alone is forgotten, as abandon does). False: not its running
        record (it was dropped)."""
        rec = self._running(tenant, key, owner)
        if rec is None:
            return False
        records, nbytes = self._tenants[tenant], result_bytes(result)
        if nbytes > self.max_bytes:
            self.too_large += 1
            del records[key]
            return True
        for k in [k for k, r in records.items() if r.done]:  # oldest use first
            if self._bytes.get(tenant, 0) + nbytes <= self.max_bytes:
                break
            self._drop(tenant, k)
        rec.result, rec.done, rec.expires, rec.nbytes = result, True, self.clock() + self.ttl_s, nbytes
        self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        return True

    def bytes_held(self, tenant: str) -> int:
        """The tenant's finished results' result_bytes."""
        return self._bytes.get(tenant, 0)

    def _drop(self, tenant: str, key: str) -> None:
        rec = self._tenants[tenant].pop(key)
        if rec.nbytes:
            self._bytes[tenant] -= rec.nbytes

    def abandon(self, tenant: str, key: str, owner: str | None = None) -> bool:
        """Forget `owner`'s run (a retry runs again). False: not its running record."""
        rec = self._running(tenant, key, owner)
        if rec is not None:
            del self._tenants[tenant][key]
        return rec is not None

    def _running(self, tenant: str, key: str, owner: str | None) -> _Record | None:
        rec = self._tenants.get(tenant, {}).get(key)
        return rec if rec is not None and not rec.done and rec.owner == owner else None

    def renew(self, owner: str) -> None:
        """The owner is alive: its running records are kept for lease_s more."""
        self._leases[owner] = self.clock() + self.lease_s

    def lapsed(self) -> list[tuple[str, str]]:
        """Drop the running records of owners whose lease lapsed (a dead ingress): their
        (tenant, key)s, whose waiters the caller wakes."""
        now = self.clock()
        gone = {o for o, until in self._leases.items() if until <= now}
        for o in gone:
            del self._leases[o]
        dropped = [(t, k) for t, records in self._tenants.items() for k, r in records.items()
                   if not r.done and r.owner is not None and r.owner not in self._leases]
        for t, k in dropped:
            del self._tenants[t][k]
        return dropped

    def owned_running(self) -> int:
        """Running records that an ingress's lease holds (what lapsed() may drop)."""
        return sum(not r.done and r.owner is not None for records in self._tenants.values() for r in records.values())

    def join(self, tenant: str, key: str) -> bool:
        """One more duplicate waits on a running key; False when max_waiters already do."""
        rec = self._tenants.get(tenant, {}).get(key)
        if rec is None or rec.done:
            return True  # nothing to wait for: the caller asks again at once
        if rec.waiters >= self.max_waiters:
            return False
        rec.waiters += 1
        return True

    def leave(self, tenant: str, key: str) -> None:
        rec = self._tenants.get(tenant, {}).get(key)
        if rec is not None and rec.waiters > 0:
            rec.waiters -= 1

    def __len__(self) -> int:
        return sum(len(r) for r in self._tenants.values())

    def _evict_one(self, tenant: str) -> bool:
        for k, r in self._tenants[tenant].items():  # oldest use first; a running record is never dropped
            if r.done:
                self._drop(tenant, k)
                return True
        return False

    def _expire(self, tenant: str) -> None:
        now = self.clock()
        for k in [k for k, r in self._tenants[tenant].items() if r.expires <= now]:
            self._drop(tenant, k)


class Idempotent:
    """Runs a non-streaming request at most once per (tenant, key) within the TTL, across ingress
    replicas, through the admission actor's IdempotencyStore.

    A duplicate that waits holds one of its tenant's in-flight slots (admission.reserve) and is one
    of at most `idempotency_max_waiters` on its key. Every actor call is bounded by
    `actor_timeout_s`: `begin` fails closed (UNAVAILABLE: without the store, running could run
    twice); `finish`/`abandon` failing is logged (the record expires, waiters time out)."""

    def __init__(self, actor, admission: Admission, lease_s: float = LEASE_S):
        self.actor = actor
        self.admission = admission
        opts = admission.config.admission
        self.wait_s = opts.idempotency_wait_s
        self.timeout_s = opts.actor_timeout_s
        self.owner = uuid.uuid4().hex  # this ingress replica, owner of the records it runs
        self.lease_s = lease_s
        self._running = 0  # requests this ingress runs under a key: renewing while > 0
        self._renewing: asyncio.Task | None = None

    async def _call(self, method, *args, timeout_s: float | None = None):
        return await asyncio.wait_for(method.remote(*args), timeout_s or self.timeout_s)

    async def run(self, tenant: str, key: str, fingerprint: str, execute: Callable[[], Awaitable[object]],
                  succeeded: Callable[[object], bool]) -> object:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                state, result = await self._call(self.actor.begin, tenant, key, fingerprint, self.owner)
            except Exception as e:  # noqa: BLE001 — fail closed
                raise ServingError(Code.UNAVAILABLE, f"the idempotency store is unavailable ({e!r}); "
                                                     f"retry with the same Idempotency-Key", 1.0) from e
            if state == "done":
                return result
            if state == "conflict":
                raise ServingError(Code.FAILED_PRECONDITION,
                                   f"Idempotency-Key {key!r} was already used with a different request")
            if state == "full":
                raise Rejected(f"tenant {tenant!r} has {self.admission.config.admission.idempotency_max_keys} "
                               f"requests with an Idempotency-Key running", 1.0, reason="concurrency")
            if state == "running":
                if time.monotonic() >= deadline:
                    raise ServingError(Code.ABORTED, f"the request with Idempotency-Key {key!r} is still running")
                await self._wait(tenant, key, deadline)
                continue
            self._hold(1)
            try:
                result = await execute()
            except BaseException:
                await self._settle(self.actor.abandon, tenant, key, self.owner)
                raise
            finally:
                self._hold(-1)
            if succeeded(result):
                await self._settle(self.actor.finish, tenant, key, result, self.owner)
            else:  # an error is not stored: the client may retry with the same key
                await self._settle(self.actor.abandon, tenant, key, self.owner)
            return result

    def _hold(self, n: int) -> None:
        """Count a run in or out; the lease is renewed while any runs."""
        self._running += n
        if self._running > 0 and (self._renewing is None or self._renewing.done()):
            self._renewing = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        while self._running > 0:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self._call(self.actor.renew, self.owner)
            except Exception as e:  # noqa: BLE001 — the next renewal may reach it; past lease_s the keys are freed
                log.warning("idempotency store: renewing this ingress's lease failed (%r)", e)

    async def _wait(self, tenant: str, key: str, deadline: float) -> None:
        """Wait for the running request, holding an in-flight slot of the tenant's."""
        ticket = self.admission.reserve(tenant)  # Rejected: the tenant is at its cap
        try:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                joined = await self._call(self.actor.wait, tenant, key, left, timeout_s=left + self.timeout_s)
            except Exception as e:  # noqa: BLE001
                raise ServingError(Code.UNAVAILABLE, f"the idempotency store is unavailable ({e!r})", 1.0) from e
            if not joined:
                raise Rejected(f"{self.admission.config.admission.idempotency_max_waiters} requests already wait "
                               f"for Idempotency-Key {key!r}", 1.0, reason="concurrency")
        finally:
            ticket.done()

    async def _settle(self, method, *args) -> None:
        try:
            await self._call(method, *args)
        except Exception as e:  # noqa: BLE001
            log.warning("idempotency store: %s failed (%r); the record expires after its TTL", method, e)
