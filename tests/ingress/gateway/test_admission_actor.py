"""The admission actor's idempotency records across ingress replicas, on Ray: an ingress that
dies mid-request frees its keys within its lease (4/3 lease_s), not at the TTL."""

import asyncio
import time

import ray

from cluster.config import AppConfig
from router.ingress.gateway.admission import Admission
from router.ingress.gateway.admission_actor import AdmissionActor
from router.ingress.gateway.front_door import local_quotas
from router.ingress.gateway.idempotency import Idempotent
from router.ingress.status import Code, ServingError

LEASE_S = 1.5


def idempotent(store, wait_s: float) -> Idempotent:
    cfg = AppConfig.model_validate({"admission": {"idempotency_wait_s": wait_s}})
    return Idempotent(store, Admission(cfg, local_quotas()), lease_s=LEASE_S)


@ray.remote
class IngressLike:
    """An ingress replica as far as the store sees it: its own Idempotent, running a request that
    never ends under a key."""

    def __init__(self, store):
        self.idem = idempotent(store, 60.0)

    async def run_forever(self, key: str) -> None:
        started = asyncio.Event()

        async def execute():
            started.set()
            await asyncio.Event().wait()

        self.task = asyncio.ensure_future(self.idem.run("t", key, "fp", execute, succeeded=bool))
        await started.wait()


def duplicate(store, key: str, wait_s: float):
    """Another ingress's request with the same key: ("ran", seconds) when it ran it itself, or the
    ServingError it got."""
    async def execute():
        return {"ran": True}

    async def go():
        return await idempotent(store, wait_s).run("t", key, "fp", execute, succeeded=bool)

    t0 = time.monotonic()
    try:
        return asyncio.run(go()), time.monotonic() - t0
    except ServingError as e:
        return e, time.monotonic() - t0


def test_a_killed_ingress_frees_its_running_keys_within_its_lease(ray_session):
    store = AdmissionActor.remote(lease_s=LEASE_S)
    owner = IngressLike.remote(store)
    ray.get(owner.run_forever.remote("k"), timeout=30)
    # alive, it renews: a duplicate waits 2 leases and is told the request still runs
    err, took = duplicate(store, "k", wait_s=2 * LEASE_S)
    assert (err.code, err.message) == (Code.ABORTED, "the request with Idempotency-Key 'k' is still running")
    ray.kill(owner)
    result, took = duplicate(store, "k", wait_s=10.0)  # was: ABORTED after 10 s (the record lived 600 s)
    assert result == {"ran": True}
    assert took <= 4 / 3 * LEASE_S + 1.0  # the lease's bound, and 1 s for Ray's calls on two shared cores
    ray.kill(store)
