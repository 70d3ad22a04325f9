"""The admission actor: cluster-wide rate-limit buckets and idempotency records, shared by every
ingress replica (a thin Ray shell over router/ingress/gateway/admission.py's plain classes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from cluster.config import AdmissionOptions
from router.actor import ConfiguredRef, keep, restored, scoped_name, serve_app
from router.ingress.gateway.admission import Quotas
from router.ingress.gateway.idempotency import LEASE_S, MAX_RESULT_BYTES, IdempotencyStore

ADMISSION = "admission"


@dataclass(frozen=True)
class AdmissionSettings:
    """What the admission actor takes from the config (admission.idempotency_*)."""

    idempotency_ttl_s: float = 600.0
    idempotency_max_keys: int = 1024
    idempotency_max_waiters: int = 8

    @classmethod
    def of(cls, o: AdmissionOptions) -> "AdmissionSettings":
        return cls(o.idempotency_ttl_s, o.idempotency_max_keys, o.idempotency_max_waiters)


@ray.remote(num_cpus=0, max_restarts=-1)
class AdmissionActor:
    """Cluster-wide rate-limit buckets and idempotency records (router/ingress/gateway/admission.py), shared by
    every ingress replica of one app. Restarted by Ray if it dies, with the settings it last ran with
    (router/actor.py `restored`): buckets start full again and idempotency records are lost (a
    retry after a restart runs again). `configure` applies changed settings in place.
    A running record belongs to the ingress running it: when that ingress stops renewing its
    lease (it died), its records are dropped within 4/3 lease_s (gateway/idempotency.py).
    `max_result_bytes`: the finished results kept per tenant, in bytes of their JSON (64 MiB; the
    least recently used go first; a larger one is not kept). Not in AdmissionOptions yet."""

    def __init__(self, settings: AdmissionSettings = AdmissionSettings(), lease_s: float = LEASE_S,
                 max_result_bytes: int = MAX_RESULT_BYTES):
        self.settings = s = restored(settings)
        self.quotas = Quotas()
        self.results = IdempotencyStore(s.idempotency_ttl_s, max_keys=s.idempotency_max_keys,
                                        max_waiters=s.idempotency_max_waiters, lease_s=lease_s,
                                        max_bytes=max_result_bytes)
        self._settled: dict[tuple[str, str], asyncio.Event] = {}
        self._sweeping: asyncio.Task | None = None

    async def configure(self, settings: AdmissionSettings) -> AdmissionSettings:
        """Run with these settings from now on (the records kept stay; a lower max_keys refuses new
        keys until enough finish or expire)."""
        if settings != self.settings:
            r = self.results
            r.ttl_s, r.max_keys, r.max_waiters = (settings.idempotency_ttl_s, settings.idempotency_max_keys,
                                                  settings.idempotency_max_waiters)
            self.settings = settings
            keep(settings)
        return self.settings

    async def take(self, tenant: str, kind: str, per_min: float, need: float, want: float):
        return self.quotas.take(tenant, kind, per_min, need, want)

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str | None = None):
        state, result = self.results.begin(tenant, key, fingerprint, owner)
        if state == "run":
            self._settled[(tenant, key)] = asyncio.Event()
            if owner is not None and (self._sweeping is None or self._sweeping.done()):
                self._sweeping = asyncio.ensure_future(self._sweep())
        return state, result

    async def finish(self, tenant: str, key: str, result, owner: str | None = None) -> None:
        if self.results.finish(tenant, key, result, owner):  # else: not its record (dropped, maybe run again)
            self._settle(tenant, key)

    async def abandon(self, tenant: str, key: str, owner: str | None = None) -> None:
        if self.results.abandon(tenant, key, owner):
            self._settle(tenant, key)

    async def renew(self, owner: str) -> None:
        self.results.renew(owner)

    async def _sweep(self) -> None:
        """Every lease_s / 3 while an ingress's lease holds running records: drop those of the
        ingresses gone silent and wake their waiters (one of them runs the request)."""
        while self.results.owned_running():
            await asyncio.sleep(self.results.lease_s / 3)
            for tenant, key in self.results.lapsed():
                self._settle(tenant, key)

    async def wait(self, tenant: str, key: str, timeout_s: float) -> bool:
        """Until the running request with this key finishes or is abandoned (or timeout_s).
        False at once when max_waiters duplicates already wait on it."""
        event = self._settled.get((tenant, key))
        if event is None:
            return True
        if not self.results.join(tenant, key):
            return False
        try:
            await asyncio.wait_for(event.wait(), max(timeout_s, 0.0))
        except (TimeoutError, asyncio.TimeoutError):
            pass
        finally:
            self.results.leave(tenant, key)
        return True

    def _settle(self, tenant: str, key: str) -> None:
        event = self._settled.pop((tenant, key), None)
        if event is not None:
            event.set()


def get_admission(options: AdmissionOptions | None = None, app: str | None = None) -> ConfiguredRef:
    """The app's admission actor (None: the caller's app), running with these options' settings."""
    return ConfiguredRef(AdmissionActor, scoped_name(app or serve_app(), ADMISSION),
                         AdmissionSettings.of(options or AdmissionOptions()))
