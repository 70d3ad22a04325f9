"""The ledger actor: every tenant's monthly spend for one Serve app (a thin Ray shell over
router/ingress/gateway/budget.py's Ledger). Detached, named per app (router/actor.py), restarted by
Ray, pinned to the head node where its file is, and holding that file's lock: a second app's ledger
on the same file is refused, naming budgets.ledger_path. A restarted ledger runs with the settings
it last ran with and reads its file back. Each call that changes the ledger returns only once the
file holding the change is fsynced; calls arriving while a save runs share the next one (group
commit)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import ray

from cluster.config import BudgetOptions
from cluster.config.front_door import state_path
from router.actor import ConfiguredRef, Exclusive, keep, restored, scoped_name, serve_app
from router.ingress.gateway.audit_actor import HEAD_NODE
from router.ingress.gateway.budget import Ledger, usd

LEDGER = "ledger"


@dataclass(frozen=True)
class LedgerSettings:
    """What the ledger takes from the config: budgets.ledger_path and budgets.reservation_ttl_s."""

    path: str | None
    reservation_ttl_s: float

    @classmethod
    def of(cls, o: BudgetOptions) -> "LedgerSettings":
        return cls(o.ledger_path, o.reservation_ttl_s)


def _lock_path(ledger: Path) -> Path:
    return ledger.with_name(f".{ledger.name}.lock")


@ray.remote(num_cpus=0, max_restarts=-1, resources=HEAD_NODE)
class LedgerActor:
    def __init__(self, settings: LedgerSettings):
        self.settings = s = restored(settings)
        # None: the default state directory of the user this actor runs as, on this (the head) node
        path = state_path(s.path, "ledger.json")
        self._file_lock = Exclusive(_lock_path(path), "budgets.ledger_path")
        self.ledger = Ledger(path, s.reservation_ttl_s)
        self._changes = 0  # mutations so far
        self._saved = 0  # mutations covered by the file
        self._lock = asyncio.Lock()
        self._metrics = None
        try:
            from cluster.telemetry.metrics import ledger_metrics  # noqa: PLC0415

            self._metrics = ledger_metrics()
        except Exception:  # noqa: BLE001 — no Ray metrics agent
            pass

    async def configure(self, settings: LedgerSettings) -> LedgerSettings:
        """Run with these settings from now on. Another file: its lock is taken and it is read
        (its own spend, not this one's) once no save is running; a refusal (the file is another
        app's ledger's) raises and leaves the ledger as it was."""
        if settings == self.settings:
            return settings
        async with self._lock:
            path = state_path(settings.path, "ledger.json")
            if path == self.ledger.path:
                self.ledger.ttl_s = settings.reservation_ttl_s
            else:
                lock = Exclusive(_lock_path(path), "budgets.ledger_path")
                try:
                    ledger = Ledger(path, settings.reservation_ttl_s)
                except BaseException:
                    lock.release()
                    raise
                if self._saved < self._changes:  # the old file gets every change made to it first
                    upto, data = self._changes, self.ledger.to_json()
                    await asyncio.get_running_loop().run_in_executor(None, self.ledger.save, data)
                    self._saved = upto
                self._file_lock.release()
                self.ledger, self._file_lock = ledger, lock
            self.settings = settings
            keep(settings)
        self._export()
        return settings

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


def get_ledger(options: BudgetOptions, app: str | None = None) -> ConfiguredRef:
    """The app's ledger actor (None: the caller's app), running with these options' settings."""
    return ConfiguredRef(LedgerActor, scoped_name(app or serve_app(), LEDGER), LedgerSettings.of(options),
                         options={"max_concurrency": 1000})
