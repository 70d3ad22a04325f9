"""Budgets and cost: what a request costs at the model's prices, and each tenant's monthly spend.

Money is counted in integer micro-dollars (µUSD); a request's cost is rounded up to the next µUSD.

A tenant with `monthly_budget_usd` reserves its request's worst case at admission:
    prompt tokens x prompt price + max_tokens x completion price
in the ledger actor (one for the cluster, so every ingress replica sees the same month). The
ledger refuses a reservation that would take settled + reserved spend past the budget (429 with an
`insufficient_quota` error), so concurrent requests can never together pass it: with the ledger
reachable the overspend is 0 (each request may pay up to 1 µUSD of rounding up). At its end the
request settles its actual cost (prompt + completion tokens sent; nothing when no token was
sent) and the rest of the reservation is refunded. A reservation whose ingress died before
settling is charged in full after `reservation_ttl_s` (never less than was used).

Ledger unreachable (down, or slower than `budgets.timeout_s`) at admission: `when_unreachable:
closed` refuses with UNAVAILABLE (overspend stays 0); `open` admits the request unchecked and
charges its actual cost when the ledger answers again (overspend bounded only by the traffic
admitted while it is down). Tenants without a budget are charged at the end, off the request path.

Whatever happens to the caller, a reservation is settled or released at the request's end: a
reserve call that timed out or whose caller went away may still have reserved, so its request ends
with `Ledger.finish` (settle the reservation if it is open, else charge), never leaving it to
expire at the worst case, and never charging twice. Only an ingress that dies mid-request leaves a
reservation to `reservation_ttl_s`.

The ledger persists each change as one line of an append-only journal (fsynced, shared by the
calls that arrive together) before it answers the call, compacted into a snapshot file when the
journal passes its bound (ledger_journal.py), so a restart keeps the month's spend and open
reservations exactly.

`Ledger` is plain Python with an injected clock; budget_actor.py is its Ray shell.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import logging
import time
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from router.ingress.gateway.ledger_journal import COMPACT_BYTES, Journal
from router.ingress.gateway.stages import Outcome, Stage
from router.ingress.status import Code, Rejected, ServingError

if TYPE_CHECKING:
    from cluster.config import AppConfig, ModelPrice

log = logging.getLogger(__name__)

MICROS = 1_000_000
CHARGED_IDS_KEPT = 2048  # ids of end-of-request charges remembered (and saved), so a retried charge counts once
HISTORY_MONTHS = 24
SETTLE_TRIES = 8


def to_micros(usd: float) -> int:
    return int((Decimal(str(usd)) * MICROS).to_integral_value(rounding="ROUND_HALF_UP"))


def usd(micros: int) -> float:
    return micros / MICROS


def cost_micros(price: "ModelPrice | None", prompt_tokens: int, completion_tokens: int) -> int:
    """Exact in decimal, rounded up to a whole µUSD (prices are per 1,000 tokens)."""
    if price is None:
        return 0
    exact = (Decimal(str(price.prompt_per_1k)) * prompt_tokens
             + Decimal(str(price.completion_per_1k)) * completion_tokens) * MICROS / 1000
    return int(exact.to_integral_value(rounding="ROUND_CEILING"))


def month_of(t: float) -> str:
    return time.strftime("%Y-%m", time.gmtime(t))


def next_month_start(t: float) -> float:
    y, m = time.gmtime(t)[:2]
    y, m = (y + 1, 1) if m == 12 else (y, m + 1)
    return float(calendar.timegm((y, m, 1, 0, 0, 0)))


class Ledger:
    """Each tenant's month: settled spend, open reservations (id -> [µUSD, created]) and the
    budget it was last checked against. Every call that may change it is a record (its verb, its
    arguments, the time it ran at and the ttl it ran with) kept in `pending` until the owner
    writes it to the journal (`take`, then `journal.append`; or `save`); replaying the records
    on the snapshot gives the same state exactly (ledger_journal.py)."""

    def __init__(self, path: str | Path, reservation_ttl_s: float = 3600.0, clock: Callable[[], float] = time.time,
                 compact_bytes: int = COMPACT_BYTES):
        self.path = Path(path)
        self.ttl_s = reservation_ttl_s
        self.clock = clock
        self.month: str | None = None  # set by the first change (replayed at its own time)
        self.tenants: dict[str, dict] = {}
        self.history: dict[str, dict[str, int]] = {}
        self.charged: list[str] = []
        self._charged: set[str] = set()
        self.seq = 0  # changes made (and recorded) so far
        self.pending: list[str] = []  # records not yet handed to the journal
        self._now = None
        self._changed = False
        self.journal = Journal(self.path, compact_bytes)
        snapshot, records = self.journal.load()
        if snapshot is not None:
            self._load(snapshot)
        for r in records:
            self._replay(r)

    def _load(self, data: dict) -> None:
        self.month, self.tenants, self.history = data["month"], data["tenants"], data.get("history", {})
        self.charged = data.get("charged", [])
        self._charged = set(self.charged)
        self.seq = data.get("seq", 0)

    def to_json(self) -> str:
        return json.dumps({"month": self.month, "tenants": self.tenants, "history": self.history,
                           "charged": self.charged, "seq": self.seq}, sort_keys=True)

    def _op(self, verb: str, *args, always: bool = True):
        """Run a verb at one instant and record it (`always` False: only if it changed anything)."""
        self._now, self._changed = self.clock(), False
        try:
            result = getattr(self, "_" + verb)(*args)
        finally:
            at, self._now = self._now, None
        if always or self._changed:
            self.seq += 1
            self.pending.append(json.dumps({"seq": self.seq, "at": at, "ttl": self.ttl_s, "op": verb,
                                            "args": list(args)}))
        return result

    def _replay(self, record: dict) -> None:
        ttl, self.ttl_s = self.ttl_s, record["ttl"]
        self._now = record["at"]
        try:
            getattr(self, "_" + record["op"])(*record["args"])
        finally:
            self._now, self.ttl_s = None, ttl
        self.seq = record["seq"]

    def take(self) -> tuple[list[str], int]:
        """The records not yet written, and the seq they reach; the caller writes them, or hands
        them back (`untake`) when the write failed."""
        lines, self.pending = self.pending, []
        return lines, self.seq

    def untake(self, lines: list[str]) -> None:
        self.pending[:0] = lines

    def save(self) -> None:
        """Every change made durable (the journal), compacted into a snapshot past its bound."""
        lines, _ = self.take()
        try:
            self.journal.append(lines)
        except BaseException:
            self.untake(lines)
            raise
        if self.journal.over_bound():
            self.journal.compact(self.to_json())  # it holds every change: any pending ones too
            self.pending.clear()

    # ---- the month ------------------------------------------------------------------------------

    def _tenant(self, tenant: str) -> dict:
        now = self._now
        month = month_of(now)
        if self.month is None:
            self.month = month
        elif month != self.month:  # a new month: spend starts again; open reservations carry over
            self._changed = True
            self.history[self.month] = {t: s["spent"] for t, s in self.tenants.items()}
            for old in sorted(self.history)[:-HISTORY_MONTHS]:
                del self.history[old]
            for s in self.tenants.values():
                s["spent"] = 0
            self.month = month
        state = self.tenants.setdefault(tenant, {"spent": 0, "reserved": {}, "budget": None})
        for rid, (amount, created) in list(state["reserved"].items()):
            if now - created > self.ttl_s:  # its ingress never settled it: charged in full
                del state["reserved"][rid]
                state["spent"] += amount
                self._changed = True
                log.warning("budget: reservation %s of tenant %r expired unsettled: charged in full", rid, tenant)
        return state

    def _touch(self) -> None:
        for t in list(self.tenants):
            self._tenant(t)

    @staticmethod
    def _reserved(state: dict) -> int:
        return sum(amount for amount, _ in state["reserved"].values())

    # ---- the verbs --------------------------------------------------------------------------

    def reserve(self, tenant: str, rid: str, amount: int, budget: int) -> tuple[bool, int, int]:
        """Hold `amount` µUSD for request `rid` if settled + reserved + amount <= budget.
        (granted, spent, reserved) in µUSD, after the call. A repeated id is granted again."""
        return self._op("reserve", tenant, rid, amount, budget)

    def _reserve(self, tenant: str, rid: str, amount: int, budget: int) -> tuple[bool, int, int]:
        state = self._tenant(tenant)
        state["budget"] = budget
        if rid in state["reserved"]:
            return True, state["spent"], self._reserved(state)
        reserved = self._reserved(state)
        if state["spent"] + reserved + amount > budget:
            return False, state["spent"], reserved
        state["reserved"][rid] = [amount, self._now]
        return True, state["spent"], reserved + amount

    def settle(self, tenant: str, rid: str, actual: int) -> bool:
        """Replace the reservation by the actual cost. False (and nothing changes) when it is not
        open: settled already, or expired and charged in full."""
        return self._op("settle", tenant, rid, actual)

    def _settle(self, tenant: str, rid: str, actual: int) -> bool:
        state = self._tenant(tenant)
        if state["reserved"].pop(rid, None) is None:
            return False
        state["spent"] += actual
        return True

    def finish(self, tenant: str, rid: str, actual: int) -> bool:
        """The cost of a request whose reservation may or may not have been made (its reserve call
        timed out or its caller went away): settle the reservation if it is open, else charge once.
        Never both, and an open reservation never waits for its expiry."""
        return self._op("finish", tenant, rid, actual)

    def _finish(self, tenant: str, rid: str, actual: int) -> bool:
        if rid in self._tenant(tenant)["reserved"]:
            return self._settle(tenant, rid, actual)
        return self._charge(tenant, rid, actual) if actual else False

    def charge(self, tenant: str, rid: str, actual: int) -> bool:
        """Add a cost with no reservation (no budget, or admitted while the ledger was
        unreachable). Once per id (the last CHARGED_IDS_KEPT ids are remembered)."""
        return self._op("charge", tenant, rid, actual)

    def _charge(self, tenant: str, rid: str, actual: int) -> bool:
        if rid in self._charged:
            return False
        state = self._tenant(tenant)
        state["spent"] += actual
        self.charged.append(rid)
        self._charged.add(rid)
        if len(self.charged) > CHARGED_IDS_KEPT:
            self._charged.discard(self.charged.pop(0))
        return True

    def snapshot(self) -> dict:
        """Each tenant's month in USD, for `pdserve budget` and the metrics. Rolling the month or
        expiring reservations on the way is a change: recorded."""
        self._op("touch", always=False)
        return {"month": self.month or month_of(self.clock()), "tenants": {
            t: {"spent_usd": usd(s["spent"]), "reserved_usd": usd(self._reserved(s)),
                "open_reservations": len(s["reserved"]),
                "budget_usd": None if s["budget"] is None else usd(s["budget"])}
            for t, s in sorted(self.tenants.items())}}


# ---- the ingress side -------------------------------------------------------------------------------

class BudgetExhausted(Rejected):
    """429 with OpenAI's `insufficient_quota` error type (RESOURCE_EXHAUSTED on gRPC)."""

    error_type = "insufficient_quota"

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message, retry_after_s, reason="budget")


class Hold:
    """One request's place in the ledger; `settle` once at its end (off the request path).
    `reserved`: True (a reservation was granted: settled), False (none was made: charged), or
    None (unknown: its reserve call failed or was cancelled, so the ledger may hold one; `finish`
    settles it if so, else charges)."""

    def __init__(self, budget: "Budget", tenant: str, rid: str, reserved: bool | None):
        self.budget, self.tenant, self.rid, self.reserved = budget, tenant, rid, reserved
        self.cost = 0

    def settle(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The request's cost in USD (0 when it sent no token); the ledger is told in the background."""
        b = self.budget
        self.cost = cost_micros(b.price, prompt_tokens, completion_tokens) if completion_tokens else 0
        if self.reserved is not False or self.cost:
            b.background(self)
        return usd(self.cost)


class Budget:
    """One ingress replica's view: prices and budgets from the config, the ledger actor for the rest."""

    def __init__(self, config: "AppConfig", ledger: Callable[[], object], metrics=None):
        self.options = config.budgets
        self.model = config.model_name
        self.price = self.options.prices.get(config.model_name)
        self.budgets = {t: to_micros(o.monthly_budget_usd) for t, o in config.tenants.items()
                        if o.monthly_budget_usd is not None}
        self._ledger_fn = ledger
        self._ledger = None
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    @property
    def ledger(self):
        if self._ledger is None:
            self._ledger = self._ledger_fn()
        return self._ledger

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return usd(cost_micros(self.price, prompt_tokens, completion_tokens))

    async def reserve(self, tenant: str, rid: str, prompt_tokens: int, max_tokens: int) -> Hold:
        """Refuses with BudgetExhausted, or UNAVAILABLE when the ledger cannot answer and the
        policy is `closed`."""
        budget = self.budgets.get(tenant)
        if budget is None:
            return Hold(self, tenant, rid, reserved=False)
        amount = cost_micros(self.price, prompt_tokens, max_tokens)
        try:
            granted, spent, reserved = await self._reserve_call(tenant, rid, amount, budget)
        except Exception as e:  # noqa: BLE001
            self._ledger = None
            if self.options.when_unreachable == "closed":
                raise ServingError(Code.UNAVAILABLE, f"the budget ledger is unavailable ({type(e).__name__}); "
                                                     f"retry later", 1.0) from e
            log.warning("budget ledger unreachable (%r): request %s of %r admitted unchecked", e, rid, tenant)
            return Hold(self, tenant, rid, reserved=None)  # the call may have reserved: finished, not charged twice
        if not granted:
            now = time.time()
            renews = next_month_start(now)
            raise BudgetExhausted(
                f"tenant {tenant!r} has used ${usd(spent + reserved):.6f} (settled ${usd(spent):.6f}, in flight "
                f"${usd(reserved):.6f}) of its monthly budget of ${usd(budget):.2f}; this request may cost up to "
                f"${usd(amount):.6f} ({prompt_tokens} prompt tokens + max_tokens {max_tokens} at {self.model}'s "
                f"prices). The budget renews on {time.strftime('%Y-%m-%d', time.gmtime(renews))} (UTC); a smaller "
                f"max_tokens may fit the ${usd(max(budget - spent - reserved, 0)):.6f} left", renews - now)
        return Hold(self, tenant, rid, reserved=True)

    async def _reserve_call(self, tenant: str, rid: str, amount: int, budget: int):
        """The ledger's reserve, within timeout_s. A handle that meets a dead or restarting ledger
        (Ray restarts it from its file) is dropped and the call retried while time is left: a
        repeated id is granted once, so a retry never reserves twice."""
        from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415

        deadline = time.monotonic() + self.options.timeout_s
        while True:
            try:
                return await asyncio.wait_for(self.ledger.reserve.remote(tenant, rid, amount, budget),
                                              max(deadline - time.monotonic(), 0.01))
            except (ActorUnavailableError, RayActorError):
                self._ledger = None
                if time.monotonic() + 0.05 >= deadline:
                    raise
                await asyncio.sleep(0.05)

    def uncertain(self, tenant: str, rid: str) -> Hold | None:
        """The hold of a request whose reserve call did not answer (it failed, timed out, or its
        caller was cancelled): the ledger may hold a reservation, which `finish` releases."""
        return None if tenant not in self.budgets else Hold(self, tenant, rid, reserved=None)

    def background(self, hold: Hold) -> None:
        task = asyncio.get_running_loop().create_task(self._tell(hold))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, hold: Hold) -> None:
        """Settle (or charge) with retries; if every try fails, an open reservation is charged in
        full when it expires, and an unreserved cost is lost (logged)."""
        delay = 0.1
        for attempt in range(SETTLE_TRIES):
            try:
                method = {True: self.ledger.settle, False: self.ledger.charge, None: self.ledger.finish}[hold.reserved]
                await asyncio.wait_for(method.remote(hold.tenant, hold.rid, hold.cost),
                                       max(self.options.timeout_s, 5.0))
                break
            except Exception as e:  # noqa: BLE001
                self._ledger = None
                if attempt == SETTLE_TRIES - 1:
                    log.error("budget: %s of request %s (tenant %r, $%.6f) failed %d times: %r",
                              "settling" if hold.reserved else "charging", hold.rid, hold.tenant, usd(hold.cost),
                              SETTLE_TRIES, e)
                    return
                await asyncio.sleep(delay)  # backoff between retries of a failed call
                delay = min(delay * 2, 5.0)
        if self.metrics is not None and hold.cost:
            self.metrics.spend.inc(usd(hold.cost), {"tenant": hold.tenant})



class BudgetStage(Stage):
    """The request's worst case (prompt + max_tokens) reserved against its tenant's monthly
    budget once the prompt's length is known; settled at its end with what it used."""

    def __init__(self, budget: Budget):
        self.budget = budget

    async def charge(self, o: Outcome) -> None:
        o.price = self.budget.cost_usd
        try:
            o.hold = await self.budget.reserve(o.tenant, o.rid, o.prepared.num_prompt_tokens, o.sampling.max_tokens)
        except BudgetExhausted:
            raise  # the ledger refused: it holds nothing of this request
        except BaseException:  # timed out, unreachable (closed), or the caller left mid-call: release it at the end
            o.hold = self.budget.uncertain(o.tenant, o.rid)
            raise

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.hold is not None:
            o.cost_usd = o.hold.settle(o.prepared.num_prompt_tokens, o.completion_tokens)
