"""The ledger actor: every tenant's monthly spend for the whole cluster (a thin Ray shell over
router/ingress/gateway/budget.py's Ledger). Detached, named, restarted by Ray, pinned to the head node
where its file is. Each call that changes the ledger returns only once the file holding the
change is fsynced; calls arriving while a save runs share the next one (group commit)."""

from __future__ import annotations

import asyncio

import ray

from cluster.config import BudgetOptions
from cluster.config.front_door import state_path
from router.actor import named_actor
from router.ingress.gateway.audit_actor import HEAD_NODE
from router.ingress.gateway.budget import Ledger, usd

LEDGER_NAME = "pdserve-ledger"


@ray.remote(num_cpus=0, max_restarts=-1, resources=HEAD_NODE)
class LedgerActor:
    def __init__(self, path: str | None, reservation_ttl_s: float):
        # None: the default state directory of the user this actor runs as, on this (the head) node
        self.ledger = Ledger(state_path(path, "ledger.json"), reservation_ttl_s)
        self._changes = 0  # mutations so far
        self._saved = 0  # mutations covered by the file
        self._lock = asyncio.Lock()
        self._metrics = None
        try:
            from cluster.telemetry.metrics import ledger_metrics  # noqa: PLC0415

            self._metrics = ledger_metrics()
        except Exception:  # noqa: BLE001 — no Ray metrics agent
            pass

    async def _durable(self) -> None:
        self._changes += 1
        mine = self._changes
        async with self._lock:
            if self._saved >= mine:  # a save that started after our change covered it
                return
            upto, data = self._changes, self.ledger.to_json()
            await asyncio.get_running_loop().run_in_executor(None, self.ledger.save, data)
            self._saved = upto
        self._export()

    def _export(self) -> None:
        if self._metrics is None:
            return
        for tenant, s in self.ledger.tenants.items():
            reserved = sum(a for a, _ in s["reserved"].values())
            self._metrics.spent.set(usd(s["spent"] + reserved), {"tenant": tenant})
            if s["budget"] is not None:
                self._metrics.budget.set(usd(s["budget"]), {"tenant": tenant})

    async def reserve(self, tenant: str, rid: str, amount: int, budget: int):
        result = self.ledger.reserve(tenant, rid, amount, budget)
        await self._durable()  # a refusal may have rolled the month or expired reservations: saved too
        return result

    async def settle(self, tenant: str, rid: str, actual: int) -> bool:
        done = self.ledger.settle(tenant, rid, actual)
        await self._durable()
        return done

    async def charge(self, tenant: str, rid: str, actual: int) -> bool:
        done = self.ledger.charge(tenant, rid, actual)
        await self._durable()
        return done

    async def finish(self, tenant: str, rid: str, actual: int) -> bool:
        done = self.ledger.finish(tenant, rid, actual)
        await self._durable()
        return done

    async def snapshot(self) -> dict:
        return self.ledger.snapshot()


def get_ledger(options: BudgetOptions):
    """The cluster's ledger actor, created by whoever asks first (with that caller's options)."""
    return named_actor(LedgerActor, LEDGER_NAME, options.ledger_path, options.reservation_ttl_s,
                       options={"max_concurrency": 1000})
