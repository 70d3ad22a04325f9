"""Idempotency-Key (HTTP): a non-streaming request runs at most once per (tenant, key) within a
TTL, across ingress replicas. `IdempotencyStore` is the plain, clocked store the admission actor
holds (gateway/admission_actor.py); `Idempotent` is one ingress's side of it."""

from __future__ import annotations

import asyncio
import logging
import time
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


class IdempotencyStore:
    """Results of non-streaming requests by (tenant, key), kept for a TTL. The first request with
    a key runs; a duplicate gets the stored result, or waits for the running one (`begin` says which).
    A failed run forgets its key, so a retry runs again.

    Bounded: at most `max_keys` records per tenant (the least recently used finished record makes
    room; a tenant whose records are all still running gets "full") and `max_waiters` duplicates
    waiting on one running key (`join` refuses the next)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 1024,
                 max_waiters: int = 8):
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_keys = max_keys
        self.max_waiters = max_waiters
        self._tenants: dict[str, OrderedDict[str, _Record]] = {}  # per tenant, least recently used first

    def begin(self, tenant: str, key: str, fingerprint: str) -> tuple[str, object]:
        """("run", None): execute it; ("done", result); ("running", None): wait and ask again;
        ("conflict", None): the key was used with a different request; ("full", None): the
        tenant has max_keys requests running under keys."""
        records = self._tenants.setdefault(tenant, OrderedDict())
        self._expire(records)
        rec = records.get(key)
        if rec is not None and rec.fingerprint != fingerprint:
            return "conflict", None
        if rec is None:
            if len(records) >= self.max_keys and not self._evict_one(records):
                return "full", None
            records[key] = _Record(fingerprint, self.clock() + self.ttl_s)
            return "run", None
        records.move_to_end(key)
        return ("done", rec.result) if rec.done else ("running", None)

    def finish(self, tenant: str, key: str, result: object) -> None:
        rec = self._tenants.get(tenant, {}).get(key)
        if rec is not None:
            rec.result, rec.done, rec.expires = result, True, self.clock() + self.ttl_s

    def abandon(self, tenant: str, key: str) -> None:
        self._tenants.get(tenant, {}).pop(key, None)

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

    def _evict_one(self, records: "OrderedDict[str, _Record]") -> bool:
        for k, r in records.items():  # oldest use first; a running record is never dropped
            if r.done:
                del records[k]
                return True
        return False

    def _expire(self, records: "OrderedDict[str, _Record]") -> None:
        now = self.clock()
        for k in [k for k, r in records.items() if r.expires <= now]:
            del records[k]


class Idempotent:
    """Runs a non-streaming request at most once per (tenant, key) within the TTL, across ingress
    replicas, through the admission actor's IdempotencyStore.

    A duplicate that waits holds one of its tenant's in-flight slots (admission.reserve) and is one
    of at most `idempotency_max_waiters` on its key. Every actor call is bounded by
    `actor_timeout_s`: `begin` fails closed (UNAVAILABLE: without the store, running could run
    twice); `finish`/`abandon` failing is logged (the record expires, waiters time out)."""

    def __init__(self, actor, admission: Admission):
        self.actor = actor
        self.admission = admission
        opts = admission.config.admission
        self.wait_s = opts.idempotency_wait_s
        self.timeout_s = opts.actor_timeout_s

    async def _call(self, method, *args, timeout_s: float | None = None):
        return await asyncio.wait_for(method.remote(*args), timeout_s or self.timeout_s)

    async def run(self, tenant: str, key: str, fingerprint: str, execute: Callable[[], Awaitable[object]],
                  succeeded: Callable[[object], bool]) -> object:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                state, result = await self._call(self.actor.begin, tenant, key, fingerprint)
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
            try:
                result = await execute()
            except BaseException:
                await self._settle(self.actor.abandon, tenant, key)
                raise
            if succeeded(result):
                await self._settle(self.actor.finish, tenant, key, result)
            else:  # an error is not stored: the client may retry with the same key
                await self._settle(self.actor.abandon, tenant, key)
            return result

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
