"""The ledger actor: every tenant's monthly spend for one Serve app (a thin Ray shell over
router/ingress/gateway/budget.py's Ledger). Detached, named per app (router/actor.py), restarted by
Ray, pinned to the head node where its file is, and holding that file's lock: a second app's ledger
on the same file is refused, naming budgets.ledger_path. A restarted ledger runs with the settings
it last ran with and reads its files back (snapshot + journal, ledger_journal.py). Each call that
changes the ledger returns only once its record is in the journal and the journal fsynced: one
write and one fsync for all the calls that arrived while the previous write ran (group commit).
Past its bound the journal is compacted into a snapshot."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import ray

from cluster.config import BudgetOptions
from cluster.config.front_door import state_path
from router.actor import ConfiguredRef, Exclusive, keep, restored, scoped_name, serve_app
from router.ingress.gateway.audit_actor import HEAD_NODE
from router.ingress.gateway.budget import Ledger, usd

LEDGER = "ledger"
log = logging.getLogger(__name__)


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
        self._saved = self.ledger.seq  # changes made durable
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
                await self._write()  # the old file gets every change made to it first
                self._file_lock.release()
                self.ledger, self._file_lock = ledger, lock
                self._saved = ledger.seq
            self.settings = settings
            keep(settings)
        self._export()
        return settings

    async def _durable(self) -> None:
        mine = self.ledger.seq
        async with self._lock:
            if self._saved >= mine:  # a write that started after our change covered it
                return
            await self._write()
        self._export()

    async def _write(self) -> None:
        """The pending records appended (one write, one fsync); then, past the journal's bound, a
        snapshot. Holds self._lock."""
        loop = asyncio.get_running_loop()
        ledger = self.ledger
        lines, upto = ledger.take()
        try:
            await loop.run_in_executor(None, ledger.journal.append, lines)
        except BaseException:
            ledger.untake(lines)  # written by the next call, in order
            raise
        self._saved = max(self._saved, upto)
        if ledger.journal.over_bound():
            data = ledger.to_json()
            held, upto = ledger.take()  # the snapshot holds them
            try:
                await loop.run_in_executor(None, ledger.journal.compact, data)
            except Exception as e:  # noqa: BLE001 — the journal still holds every change made durable
                ledger.untake(held)
                log.warning("ledger: compacting %s failed (%r); the journal keeps growing", ledger.path, e)
                return
            self._saved = upto

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
        snap = self.ledger.snapshot()
        if self.ledger.pending:  # it rolled the month or expired reservations
            await self._durable()
        return snap


def get_ledger(options: BudgetOptions, app: str | None = None) -> ConfiguredRef:
    """The app's ledger actor (None: the caller's app), running with these options' settings."""
    return ConfiguredRef(LedgerActor, scoped_name(app or serve_app(), LEDGER), LedgerSettings.of(options),
                         options={"max_concurrency": 1000})
