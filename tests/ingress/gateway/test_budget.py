"""Budgets without Ray: exact costs in µUSD, reservations that never let concurrent requests pass
a budget, settlement and refunds, persistence across a restart, the month's rollover, expiry of
reservations never settled, and `pdserve budget --file`."""

import asyncio
import json

import pytest

from cluster.app.cli import main
from cluster.config import ModelPrice
from router.ingress.gateway.budget import Ledger, cost_micros, next_month_start, to_micros
from router.ingress.status import ServingError

T0 = 1_795_000_000.0  # 2026-11-18 UTC
PRICE = ModelPrice(prompt_per_1k=0.5, completion_per_1k=1.5)


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


def test_costs_are_exact_micro_dollars_rounded_up():
    assert cost_micros(PRICE, 3, 2) == 4500  # (3 x 0.5 + 2 x 1.5) / 1000 USD
    assert cost_micros(ModelPrice(prompt_per_1k=0.0001), 1, 0) == 1  # 0.1 µUSD: rounded up
    assert cost_micros(ModelPrice(prompt_per_1k=0.1, completion_per_1k=0.2), 30, 30) == 9000  # no float drift
    assert cost_micros(None, 100, 100) == 0
    assert to_micros(10.01) == 10_010_000


def test_reservations_never_pass_the_budget_and_settling_refunds_the_rest(tmp_path):
    ledger = Ledger(tmp_path / "l.json", clock=Clock())
    budget = 100_000
    ledger.charge("t", "earlier", 80_000)
    # 20 requests at once, each reserving 3,000: exactly the 6 that fit are granted
    granted = [ledger.reserve("t", f"r{i}", 3_000, budget)[0] for i in range(20)]
    assert granted == [True] * 6 + [False] * 14
    assert ledger.reserve("t", "r0", 3_000, budget)[0] is True  # a retried reservation is the same one
    for i in range(6):
        assert ledger.settle("t", f"r{i}", 1_000) is True  # each used a third: the rest is refunded
    assert ledger.settle("t", "r0", 1_000) is False  # settled once
    snap = ledger.snapshot()["tenants"]["t"]
    assert (snap["spent_usd"], snap["reserved_usd"], snap["open_reservations"]) == (0.086, 0.0, 0)
    assert ledger.reserve("t", "r20", 14_000, budget)[0] is True  # exactly what is left
    assert ledger.reserve("t", "r21", 1, budget) == (False, 86_000, 14_000)


def test_a_restart_keeps_spend_and_open_reservations(tmp_path):
    path = tmp_path / "l.json"
    ledger = Ledger(path, clock=Clock())
    ledger.charge("a", "x", 5_000)
    ledger.reserve("b", "y", 7_000, 10_000)
    ledger.save()
    again = Ledger(path, clock=Clock())
    assert again.snapshot() == ledger.snapshot()
    assert again.reserve("b", "z", 3_001, 10_000)[0] is False  # the open reservation still counts
    assert again.settle("b", "y", 2_000) and again.charge("a", "x", 5_000) is False  # a charge counts once
    assert not path.with_suffix(".json.tmp").exists()


def test_a_new_month_starts_from_zero_and_keeps_the_old_month(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "l.json", clock=clock)
    ledger.charge("t", "x", 9_000)
    ledger.reserve("t", "open", 1_000, 10_000)
    assert ledger.reserve("t", "y", 1, 10_000)[0] is False
    clock.t = next_month_start(T0) + 1
    assert ledger.reserve("t", "y", 8_000, 10_000)[0] is True  # the open reservation carried over
    assert ledger.history == {"2026-11": {"t": 9_000}} and ledger.month == "2026-12"


def test_a_reservation_never_settled_is_charged_in_full_when_it_expires(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "l.json", reservation_ttl_s=60, clock=clock)
    ledger.reserve("t", "orphan", 4_000, 10_000)
    clock.t += 61
    snap = ledger.snapshot()["tenants"]["t"]
    assert (snap["spent_usd"], snap["reserved_usd"]) == (0.004, 0.0)
    assert ledger.settle("t", "orphan", 10) is False  # too late: it was charged in full


def test_pdserve_budget_reads_the_ledger_file(tmp_path, capsys):
    ledger = Ledger(tmp_path / "l.json")
    ledger.reserve("acme", "r", 2_500_000, 10_000_000)
    ledger.settle("acme", "r", 2_000_000)
    ledger.charge("free", "s", 1)
    ledger.save()
    assert main(["budget", "--file", str(tmp_path / "l.json"), "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["tenants"] == {
        "acme": {"spent_usd": 2.0, "reserved_usd": 0.0, "open_reservations": 0, "budget_usd": 10.0},
        "free": {"spent_usd": 1e-06, "reserved_usd": 0.0, "open_reservations": 0, "budget_usd": None}}
    assert main(["budget", "--file", str(tmp_path / "l.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split() == ["acme", "2.000000", "0.000000", "10.00", "20.0%"]


def test_finish_settles_an_open_reservation_or_charges_once(tmp_path):
    ledger = Ledger(tmp_path / "l.json", clock=Clock())
    assert ledger.reserve("t", "r1", 5_000, 100_000)[0] is True
    assert ledger.finish("t", "r1", 1_200) is True  # the reservation is replaced by the cost, never both
    assert ledger.finish("t", "r2", 700) is True  # no reservation was made: charged, once
    assert ledger.finish("t", "r2", 700) is False
    assert ledger.finish("t", "r3", 0) is False  # nothing reserved, nothing used
    snap = ledger.snapshot()["tenants"]["t"]
    assert (snap["spent_usd"], snap["reserved_usd"], snap["open_reservations"]) == (0.0019, 0.0, 0)


class _Call:
    """One verb of the ledger actor, as `actor.verb.remote(...)` is awaited: the plain Ledger's
    answer, after `delay` (a slow or wedged actor)."""

    def __init__(self, fn, delay: float = 0.0):
        self.fn, self.delay = fn, delay

    def remote(self, *args):
        async def call():
            result = self.fn(*args)  # the actor did it: only its answer is late
            await asyncio.sleep(self.delay)
            return result
        return call()


class _Actor:
    def __init__(self, ledger: Ledger, reserve_delay: float):
        self.reserve = _Call(ledger.reserve, reserve_delay)
        self.settle, self.charge, self.finish = _Call(ledger.settle), _Call(ledger.charge), _Call(ledger.finish)


@pytest.mark.parametrize("when, leave", [("closed", "timeout"), ("open", "timeout"), ("closed", "cancel")])
def test_every_reservation_is_settled_whatever_happens_to_its_caller(tmp_path, when, leave):
    """A reserve whose answer came too late (timeout) or whose caller left mid-call (cancel) left
    its reservation open until reservation_ttl_s charged the worst case; with `open` the request's
    cost was then charged a second time. Now the request's end settles it: what it used, once."""
    from types import SimpleNamespace

    from cluster.config import AppConfig
    from cluster.engine.sampling_params import SamplingParams
    from router.ingress.gateway.budget import Budget, BudgetStage
    from router.ingress.gateway.stages import Outcome
    from router.ingress.request import ClientRequest, Delta, SamplingSpec

    ledger = Ledger(tmp_path / "l.json", clock=Clock())
    cfg = AppConfig.model_validate({"model": "m", "served_model_name": "m", "tenants": {
        "t": {"api_keys": ["k"], "monthly_budget_usd": 10.0}}, "budgets": {
        "prices": {"m": {"prompt_per_1k": 0.5, "completion_per_1k": 1.5}}, "when_unreachable": when,
        "timeout_s": 0.05}})
    stage = BudgetStage(Budget(cfg, lambda: _Actor(ledger, reserve_delay=5.0)))
    o = Outcome("rid", ClientRequest("t", SamplingSpec()), SamplingParams(max_tokens=100), None,
                prepared=SimpleNamespace(num_prompt_tokens=10))

    async def request():
        if leave == "cancel":
            task = asyncio.ensure_future(stage.charge(o))
            await asyncio.sleep(0.01)  # the ledger has reserved; its answer is on the way
            task.cancel()
            error = await asyncio.gather(task, return_exceptions=True)
        else:
            error = await asyncio.gather(stage.charge(o), return_exceptions=True)
        if when == "open" and leave == "timeout":  # admitted unchecked: it runs and sends 2 tokens
            o.last = Delta("r", "ab", [1, 2], "length", 10, 2)
        stage.finish(o, error[0])
        await asyncio.gather(*stage.budget._tasks)
        return error[0]

    error = asyncio.run(request())
    snap = ledger.snapshot()["tenants"]["t"]
    used = cost_micros(PRICE, 10, 2) / 1e6 if when == "open" else 0.0
    assert (snap["spent_usd"], snap["reserved_usd"], snap["open_reservations"]) == (used, 0.0, 0)
    expected = {"closed": ServingError, "open": type(None)}[when] if leave == "timeout" else asyncio.CancelledError
    assert isinstance(error, expected)
