"""Admission without Ray: API keys -> tenants, size limits, in-flight limits, token buckets with
an injected clock (exact grants and retry-after), the local fast path, refunds, request contexts,
and the idempotency store."""

import asyncio

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError
from cluster.engine.request import Priority
from router.ingress.gateway.admission import Admission, Quotas, TokenBucket
from router.ingress.gateway.idempotency import IdempotencyStore
from router.ingress.status import Code, Rejected, ServingError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def config(**tenants) -> AppConfig:
    return AppConfig.model_validate({"api_keys": ["open"], "tenants": tenants})


def admission(cfg: AppConfig, clock: Clock):
    quotas = Quotas(clock)
    calls = []

    async def take(*args):
        calls.append(args)
        return quotas.take(*args)

    return Admission(cfg, take, clock=clock), calls


def run(coro):
    return asyncio.run(coro)


def test_keys_map_to_tenants_and_unknown_keys_are_refused():
    cfg = config(acme={"api_keys": ["ka1", "ka2"]}, beta={"api_keys": ["kb"]})
    adm, _ = admission(cfg, Clock())
    assert adm.authenticate("Bearer ka2") == "acme"
    assert adm.authenticate("bearer  kb ") == "beta"
    assert adm.authenticate("Bearer open") == "default"
    for bad in (None, "", "ka1", "Bearer", "Bearer nope", "Basic ka1"):
        with pytest.raises(ServingError) as e:
            adm.authenticate(bad)
        assert e.value.code is Code.UNAUTHENTICATED
    assert Admission(AppConfig(), None).authenticate(None) == "default"  # no keys, no tenants: auth off


def test_a_key_of_two_tenants_is_a_config_error():
    with pytest.raises(ValidationError, match="tenant 'b' is also a key of tenant 'a'"):
        config(a={"api_keys": ["k"]}, b={"api_keys": ["k"]})


def test_token_bucket_grants_and_says_when_to_retry():
    clock = Clock()
    b = TokenBucket(60, clock)  # one a second, one minute's worth of burst
    assert b.take(1, 50) == (50, 0.0)
    assert b.take(20, 20) == (0.0, 10.0)  # 10 left: 10 more in 10 s
    clock.t += 10
    assert b.take(20, 20) == (20, 0.0)
    clock.t += 1000
    assert b.take(1, 1000) == (60, 0.0)  # refills to capacity, no further


def test_requests_per_min_across_the_fast_path():
    clock = Clock()
    adm, calls = admission(config(a={"api_keys": ["k"], "requests_per_min": 600}), clock)
    tickets = [run(adm.admit("a", 10, 10)) for _ in range(31)]
    # one actor call took this request's 1 plus the 5% lease (30): the next 30 ran locally
    assert len(calls) == 1 and calls[0] == ("a", "requests", 600, 1, 31.0)
    for t in tickets:
        t.done(10)
    for _ in range(600 - 31):
        run(adm.admit("a", 1, 1)).done(1)
    with pytest.raises(Rejected) as e:
        run(adm.admit("a", 1, 1))
    assert e.value.code is Code.RESOURCE_EXHAUSTED and e.value.retry_after_s == pytest.approx(0.1)
    assert "requests_per_min quota (600)" in e.value.message
    clock.t += 0.1
    run(adm.admit("a", 1, 1)).done(1)


def test_noisy_tenant_is_refused_while_the_other_is_not():
    clock = Clock()
    adm, _ = admission(config(a={"api_keys": ["ka"], "requests_per_min": 3}, b={"api_keys": ["kb"]}), clock)
    results = {"a": [], "b": []}
    for _ in range(10):
        for tenant in ("a", "b"):
            try:
                run(adm.admit(tenant, 4, 4)).done(4)
                results[tenant].append("ok")
            except Rejected as e:
                results[tenant].append(e.retry_after_s)
    assert results["a"] == ["ok"] * 3 + [20.0] * 7
    assert results["b"] == ["ok"] * 10


def test_a_flood_against_a_quota_costs_one_actor_call_per_refill():
    clock = Clock()
    adm, calls = admission(config(a={"api_keys": ["ka"], "requests_per_min": 60}), clock)
    for _ in range(60):
        run(adm.admit("a", 1, 1)).done(1)
    before = len(calls)
    waits = []
    for _ in range(500):  # refused by the actor once, then here until the bucket refills
        with pytest.raises(Rejected) as e:
            run(adm.admit("a", 1, 1))
        waits.append(e.value.retry_after_s)
        clock.t += 0.001
    assert len(calls) == before + 1
    assert waits[0] == pytest.approx(1.0) and waits[-1] == pytest.approx(1.0 - 0.499)  # the time left, exact
    assert adm.total_inflight == 0
    clock.t += 0.502
    run(adm.admit("a", 1, 1)).done(1)  # refilled: the actor is asked again and grants
    assert len(calls) == before + 2


def test_a_local_refusal_never_refuses_what_the_shared_bucket_would_grant():
    """Concurrent takes leave local credit behind a cached refusal: a later request that needs less
    from the bucket than the refused one still asks it, so all 4 of the bucket's requests run."""
    clock = Clock()
    adm, calls = admission(config(a={"api_keys": ["ka"], "requests_per_min": 4}), clock)

    async def four_at_once():
        return await asyncio.gather(*(adm.admit("a", 1, 1) for _ in range(4)), return_exceptions=True)

    first = run(four_at_once())  # 3 take 1.2 each (1 + the 5% lease); the 4th finds 0.4 and is refused
    assert [isinstance(r, Rejected) for r in first] == [False, False, False, True]
    later = []
    for _ in range(4):
        try:
            later.append(run(adm.admit("a", 1, 1)))
        except Rejected:
            later.append(None)
    # the next needs only 0.4 from the bucket (0.6 of local credit): it asks and runs; then the
    # bucket is empty and the rest are refused here, with no more calls
    assert [t is not None for t in later] == [True, False, False, False]
    assert len(calls) == 4 + 1
    for t in [*first[:3], later[0]]:
        t.done(1)


def test_tokens_per_min_charges_prompt_plus_max_tokens_and_refunds_unused_output():
    clock = Clock()  # never advances: no refill
    adm, calls = admission(config(a={"api_keys": ["k"], "tokens_per_min": 1000}), clock)
    t1 = run(adm.admit("a", 100, 400))  # 500 charged: the bucket grants 500 + a 50-token lease
    t1.done(completion_tokens=100)  # 300 unused output tokens come back to this ingress
    assert adm._credits[("a", "tokens")] == 350
    run(adm.admit("a", 300, 400)).done(400)  # 700: 350 local + 350 (+ 50 lease) from the bucket, 50 left
    with pytest.raises(Rejected) as e:
        run(adm.admit("a", 100, 400))  # 500: 50 local, 450 needed, the bucket holds 50
    assert e.value.retry_after_s == pytest.approx(400 / (1000 / 60))  # 24 s
    assert [c[3:] for c in calls] == [(500, 550.0), (350, 400.0), (450, 500.0)]
    with pytest.raises(InvalidRequestError, match=r"prompt \+ max_tokens = 1001 exceeds the tokens_per_min 1000"):
        run(adm.admit("a", 1, 1000))


def test_size_limits_name_the_field_and_the_limit():
    adm, _ = admission(config(a={"api_keys": ["k"], "max_output_tokens": 64, "max_context": 100}), Clock())
    with pytest.raises(InvalidRequestError, match="max_tokens: 65 exceeds the max_output_tokens 64 of tenant 'a'"):
        run(adm.admit("a", 10, 65))
    with pytest.raises(InvalidRequestError, match=r"\(50 tokens\) \+ max_tokens \(51\) exceeds the max_context 100 of tenant 'a'"):
        run(adm.admit("a", 50, 51))
    run(adm.admit("a", 50, 50)).done()


def test_in_flight_limits_per_tenant_and_per_ingress():
    cfg = AppConfig.model_validate({"tenants": {"a": {"api_keys": ["k"], "max_concurrent": 3}},
                                    "ingress_replicas": 2, "admission": {"max_inflight": 4}})
    adm, _ = admission(cfg, Clock())
    a = [run(adm.admit("a", 1, 1)) for _ in range(2)]  # this ingress's share of 3 over 2 replicas: 2
    with pytest.raises(Rejected, match="tenant 'a' has 2 requests in flight"):
        run(adm.admit("a", 1, 1))
    others = [run(adm.admit("default", 1, 1)) for _ in range(2)]
    with pytest.raises(Rejected, match="at capacity \\(4 requests in flight"):
        run(adm.admit("default", 1, 1))
    a[0].done()
    a[0].done()  # idempotent
    assert adm.total_inflight == 3
    run(adm.admit("a", 1, 1))
    for t in a[1:] + others:
        t.done()


def test_request_context_carries_class_share_budget_and_cache_salt():
    cfg = config(a={"api_keys": ["ka"], "priority": "batch", "weight": 2, "kv_budget": 0.5},
                 b={"api_keys": ["kb"], "cache_group": "shared"}, c={"api_keys": ["kc"], "cache_group": "shared"})
    adm, _ = admission(cfg, Clock())
    ctx = adm.context("a", deadline=5.0)
    assert (ctx.tenant, ctx.priority, ctx.weight, ctx.kv_budget, ctx.cache_salt, ctx.deadline) == \
        ("a", Priority.BATCH, 2.0, 0.5, "a", 5.0)
    assert adm.context("b").cache_salt == adm.context("c").cache_salt == "shared"
    assert adm.context("default").cache_salt == ""
    shared = Admission(cfg.model_copy(update={"tenant_cache_isolation": False}), None)
    assert shared.context("a").cache_salt == ""


def test_idempotency_store_runs_once_then_returns_the_result_until_the_ttl():
    clock = Clock()
    store = IdempotencyStore(ttl_s=60, clock=clock)
    assert store.begin("t", "k", "fp") == ("run", None)
    assert store.begin("t", "k", "fp") == ("running", None)
    assert store.begin("t", "k", "other body") == ("conflict", None)
    assert store.begin("u", "k", "fp") == ("run", None)  # keys are per tenant
    store.finish("t", "k", {"id": 1})
    clock.t += 59
    assert store.begin("t", "k", "fp") == ("done", {"id": 1})
    clock.t += 1
    assert store.begin("t", "k", "fp") == ("run", None)  # expired: runs again
    store.abandon("t", "k")
    assert store.begin("t", "k", "fp") == ("run", None)  # a failed run leaves nothing behind


def test_a_silent_ingress_loses_its_running_records_when_its_lease_lapses():
    """A running record is its ingress's while that ingress renews its lease: one that stops (it
    died) loses its records lease_s after its last renewal, not at the TTL; its late finish or
    abandon then touches nothing."""
    clock = Clock()
    store = IdempotencyStore(ttl_s=600, clock=clock, lease_s=10)
    assert store.begin("t", "k", "fp", "ingress-a") == ("run", None)
    assert store.begin("t", "j", "fp", "ingress-b") == ("run", None)
    assert store.begin("t", "n", "fp") == ("run", None)  # no owner: kept until the TTL
    clock.t = 1006.0
    store.renew("ingress-b")
    clock.t = 1009.99
    assert (store.lapsed(), store.owned_running()) == ([], 2)
    clock.t = 1010.0  # a's lease, taken at 1000, lapses; b renewed at 1006
    assert (store.lapsed(), store.owned_running()) == ([("t", "k")], 1)
    assert store.begin("t", "k", "fp", "ingress-b") == ("run", None)  # a duplicate runs it again
    assert store.finish("t", "k", {"late": 1}, "ingress-a") is False
    assert store.abandon("t", "k", "ingress-a") is False
    assert store.begin("t", "k", "fp", "ingress-c") == ("running", None)  # still b's
    assert store.finish("t", "k", {"id": 2}, "ingress-b") is True
    clock.t = 1599.0  # b silent since 1010: its running j goes, its finished k and the ownerless n stay
    assert store.lapsed() == [("t", "j")]
    assert [store.begin("t", key, "fp")[0] for key in ("k", "n")] == ["done", "running"]


def test_predicted_queue_wait_over_the_bound_or_the_deadline_is_refused(tiny_model):
    import time

    from cluster.engine.request import RequestContext
    from router.ingress.gateway.capacity import Capacity

    capacity = Capacity(AppConfig(model=tiny_model, admission={"max_queue_wait_s": 2.0}).admission_bounds)
    capacity.check_queue_wait("r", 1.9, RequestContext(), ahead=3)
    with pytest.raises(Rejected, match="predicted queue wait 2.50 s exceeds max_queue_wait_s 2") as e:
        capacity.check_queue_wait("r", 2.5, RequestContext(), ahead=3)
    assert e.value.retry_after_s == pytest.approx(0.5)
    with pytest.raises(Rejected, match="left before its deadline"):
        capacity.check_queue_wait("r", 1.0, RequestContext(deadline=time.time() + 0.5), ahead=3)
    capacity.check_queue_wait("r", 1.0, RequestContext(deadline=time.time() + 30), ahead=3)
