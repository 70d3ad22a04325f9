"""The admission actor: cluster-wide rate-limit buckets and idempotency records, shared by every
ingress replica (a thin Ray shell over router/ingress/admission.py's plain classes)."""

from __future__ import annotations

import asyncio

import ray

from router.actor import ROUTER_NAMESPACE
from router.ingress.admission import IdempotencyStore, Quotas

ADMISSION_NAME = "pdserve-admission"


@ray.remote(num_cpus=0, max_restarts=-1)
class AdmissionActor:
    """Cluster-wide rate-limit buckets and idempotency records (router/ingress/admission.py), shared by
    every ingress replica. Restarted by Ray if it dies (buckets start full again)."""

    def __init__(self, idempotency_ttl_s: float = 600.0):
        self.quotas = Quotas()
        self.results = IdempotencyStore(idempotency_ttl_s)
        self._settled: dict[tuple[str, str], asyncio.Event] = {}

    async def take(self, tenant: str, kind: str, per_min: float, need: float, want: float):
        return self.quotas.take(tenant, kind, per_min, need, want)

    async def begin(self, tenant: str, key: str, fingerprint: str):
        state, result = self.results.begin(tenant, key, fingerprint)
        if state == "run":
            self._settled[(tenant, key)] = asyncio.Event()
        return state, result

    async def finish(self, tenant: str, key: str, result) -> None:
        self.results.finish(tenant, key, result)
        self._settle(tenant, key)

    async def abandon(self, tenant: str, key: str) -> None:
        self.results.abandon(tenant, key)
        self._settle(tenant, key)

    async def wait(self, tenant: str, key: str, timeout_s: float) -> None:
        """Until the running request with this key finishes or is abandoned (or timeout_s)."""
        event = self._settled.get((tenant, key))
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), max(timeout_s, 0.0))
            except (TimeoutError, asyncio.TimeoutError):
                pass

    def _settle(self, tenant: str, key: str) -> None:
        event = self._settled.pop((tenant, key), None)
        if event is not None:
            event.set()


def get_admission(idempotency_ttl_s: float = 600.0):
    """The cluster's admission actor, created by whoever asks first."""
    return AdmissionActor.options(
        name=ADMISSION_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote(idempotency_ttl_s)
