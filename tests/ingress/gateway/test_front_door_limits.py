"""The front door's limits without Ray: atomic in-flight limits under concurrency, tokenizing only
after the cheap checks, idempotency bounds and actor timeouts, API keys from env and files (hashed,
never given to engine replicas), and the exposure rule."""

import asyncio
import json
import threading
import time

import pytest

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError
from router.ingress.gateway.admission import Admission, Quotas, key_digest, load_key_digests
from router.ingress.gateway.idempotency import IdempotencyStore, Idempotent
from router.ingress.status import Code, Rejected, ServingError


def local_take():
    quotas = Quotas()

    async def take(*args):
        await asyncio.sleep(0)  # an await between check and grant, as the actor call has
        return quotas.take(*args)

    return take


# ---- atomic limits ---------------------------------------------------------------------------

def test_fifty_concurrent_requests_admit_exactly_the_caps():
    cfg = AppConfig.model_validate({
        "tenants": {"a": {"api_keys": ["ka"], "max_concurrent": 2, "requests_per_min": 10**6}},
        "admission": {"max_inflight": 4}})
    adm = Admission(cfg, local_take())

    async def main():
        async def one(tenant):
            try:
                return await adm.admit(tenant, 4, 4)
            except Rejected:
                return None

        tickets = await asyncio.gather(*[one(t) for _ in range(50) for t in ("a", "default")])
        admitted = [t for t in tickets if t is not None]
        counts = {name: sum(t.tenant == name for t in admitted) for name in ("a", "default")}
        assert (len(admitted), counts, adm.total_inflight) == (4, {"a": 2, "default": 2}, 4)
        for t in admitted:
            t.done()
        assert adm.total_inflight == 0 and adm.inflight_by_tenant() == {"a": 0, "default": 0}

    asyncio.run(main())


def test_a_refusal_after_the_reservation_gives_the_slot_back():
    cfg = AppConfig.model_validate({"tenants": {"a": {"api_keys": ["k"], "max_concurrent": 1,
                                                      "max_output_tokens": 8}}})
    adm = Admission(cfg, local_take())
    with pytest.raises(InvalidRequestError, match="max_output_tokens 8"):
        asyncio.run(adm.admit("a", 1, 9))
    assert adm.total_inflight == 0
    asyncio.run(adm.admit("a", 1, 8)).done()


def test_tokenizing_runs_off_the_loop_and_only_after_the_cheap_checks(tiny_model):
    from tests.helpers import front_door, generate

    cfg = AppConfig.model_validate({"model": tiny_model, "admission": {"max_inflight": 1}})
    door = front_door(cfg)
    flow = door.catalog.default
    threads = []
    real = flow.validator

    class Spy:  # wraps the validator from outside
        def __getattr__(self, name):
            return getattr(real, name)

        def make_request(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return real.make_request(*args, **kwargs)

    flow.validator = Spy()

    async def first(prompt):
        return await anext(generate(door, prompt, max_tokens=2))

    held = door.admission.reserve("default")  # the ingress is at capacity
    with pytest.raises(Rejected, match="at capacity"):
        asyncio.run(first("x" * 100_000))
    assert threads == []  # refused before any tokenizing
    held.done()
    with pytest.raises(ServingError):  # admitted, tokenized, then no decode pool (None here)
        asyncio.run(first("hello"))
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    assert door.admission.total_inflight == 0


# ---- idempotency bounds ----------------------------------------------------------------------

def test_idempotency_store_is_bounded_per_tenant_and_caps_waiters():
    store = IdempotencyStore(ttl_s=60, max_keys=2, max_waiters=2)
    assert store.begin("t", "k1", "f")[0] == "run"
    assert store.begin("t", "k2", "f")[0] == "run"
    assert store.begin("t", "k3", "f")[0] == "full"  # both still running: nothing may be dropped
    assert store.begin("u", "k1", "f")[0] == "run"  # another tenant has its own bound
    store.finish("t", "k1", "r1")
    store.finish("t", "k2", "r2")
    assert store.begin("t", "k1", "f") == ("done", "r1")  # k1 used last: k2 is the LRU
    assert store.begin("t", "k3", "f")[0] == "run"
    assert store.begin("t", "k2", "f")[0] == "run"  # k2 was evicted; k1 then (k3 runs)
    assert store.begin("t", "k1", "f")[0] == "full"
    assert [store.join("t", "k3") for _ in range(3)] == [True, True, False]
    store.leave("t", "k3")
    assert store.join("t", "k3")


def test_idempotency_results_are_bounded_per_tenant_in_bytes_least_recently_used_first():
    from router.ingress.gateway.idempotency import result_bytes

    store = IdempotencyStore(ttl_s=60, max_bytes=20)
    r1, r2, r3 = "x" * 6, "y" * 6, "z" * 6
    assert result_bytes(r1) == 8  # its JSON: the quotes count
    for k in ("k1", "k2", "k3", "k4"):
        assert store.begin("t", k, "f")[0] == "run"
    store.finish("t", "k1", r1)
    store.finish("t", "k2", r2)
    assert store.bytes_held("t") == 16
    assert store.begin("t", "k1", "f") == ("done", r1)  # k1 used last: k2 is the least recently used
    store.finish("t", "k3", r3)  # 24 bytes > 20: k2 makes room (k4 still runs: never dropped)
    assert (store.bytes_held("t"), store.too_large) == (16, 0)
    assert [store.begin("t", k, "f") for k in ("k1", "k3")] == [("done", r1), ("done", r3)]
    assert store.begin("t", "k2", "f") == ("run", None)  # evicted: it runs again
    store.finish("t", "k4", {"text": "w" * 30})  # 41 bytes: larger than the bound alone, not kept
    assert (store.bytes_held("t"), store.too_large) == (16, 1)  # and nothing evicted for it
    assert store.begin("t", "k4", "f") == ("run", None)
    assert [store.begin("t", k, "f") for k in ("k1", "k3")] == [("done", r1), ("done", r3)]
    assert store.begin("u", "k1", "f") == ("run", None)
    store.finish("u", "k1", r1)
    assert (store.bytes_held("u"), store.bytes_held("t")) == (8, 16)  # another tenant has its own bound


class FakeActor:
    """The admission actor's idempotency methods over a plain store; `slow` stalls begin."""

    def __init__(self, store, slow=False):
        self.store, self.slow = store, slow
        self.settled = asyncio.Event()
        outer = self

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return self.fn(*args)

        async def begin(*a):
            if outer.slow:
                await asyncio.Event().wait()
            return store.begin(*a)

        async def wait(tenant, key, timeout_s):
            if not store.join(tenant, key):
                return False
            try:
                await asyncio.wait_for(outer.settled.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
            store.leave(tenant, key)
            return True

        async def finish(*a):
            store.finish(*a)
            outer.settled.set()

        async def abandon(*a):
            store.abandon(*a)
            outer.settled.set()

        self.begin, self.wait, self.finish, self.abandon = map(Method, (begin, wait, finish, abandon))


def test_duplicates_wait_holding_a_slot_and_are_capped_per_key():
    cfg = AppConfig.model_validate({"tenants": {"a": {"api_keys": ["k"], "max_concurrent": 4}},
                                    "admission": {"idempotency_max_waiters": 2}})
    adm = Admission(cfg, local_take())
    idem = Idempotent(FakeActor(IdempotencyStore(60, max_waiters=2)), adm)

    async def main():
        release = asyncio.Event()
        runs = []

        async def execute():
            runs.append(1)
            await release.wait()
            return {"ok": 1}

        async def call():
            try:
                return await idem.run("a", "key", "fp", execute, succeeded=lambda r: isinstance(r, dict))
            except ServingError as e:
                return e

        tasks = [asyncio.ensure_future(call()) for _ in range(5)]
        for _ in range(20):
            await asyncio.sleep(0)
        # one runs (its own flow would hold its slot), two wait holding a slot each, two are refused
        assert adm.inflight_by_tenant() == {"a": 2}
        release.set()
        results = await asyncio.gather(*tasks)
        refused = [r for r in results if isinstance(r, Rejected)]
        assert len(runs) == 1 and len(refused) == 2 and "2 requests already wait" in refused[0].message
        assert [r for r in results if r == {"ok": 1}] == [{"ok": 1}] * 3
        assert adm.total_inflight == 0

    asyncio.run(main())


def timed(coro, bound_s: float = 5.0):
    """(what `coro` returned or raised, seconds it took); a coroutine still running after
    `bound_s` fails the test instead of hanging it."""
    async def run():
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(coro, bound_s)
        except (ServingError, InvalidRequestError) as e:
            result = e
        return result, time.monotonic() - t0
    return asyncio.run(run())


ACTOR_TIMEOUT_S = 0.3


def test_an_unreachable_idempotency_store_fails_closed_within_the_timeout():
    """A store that never answers: UNAVAILABLE after actor_timeout_s (0.3 s), not before, not much after."""
    cfg = AppConfig.model_validate({"admission": {"actor_timeout_s": ACTOR_TIMEOUT_S}})
    idem = Idempotent(FakeActor(IdempotencyStore(60), slow=True), Admission(cfg, local_take()))

    async def never():
        raise AssertionError("must not run without the store")

    err, took = timed(idem.run("default", "k", "fp", never, succeeded=bool))
    assert (err.code, err.retry_after_s) == (Code.UNAVAILABLE, 1.0)
    assert ACTOR_TIMEOUT_S <= took < ACTOR_TIMEOUT_S + 0.25


def test_a_slow_quota_actor_fails_open_within_the_timeout():
    """A quota actor that never answers: the request is admitted (rate limits fail open) after
    actor_timeout_s (0.3 s), not before, not much after, and its slot is held until done."""
    cfg = AppConfig.model_validate({"tenants": {"a": {"api_keys": ["k"], "requests_per_min": 60}},
                                    "admission": {"actor_timeout_s": ACTOR_TIMEOUT_S}})
    calls = []

    async def stalled(*args):
        calls.append(args)
        await asyncio.Event().wait()

    adm = Admission(cfg, stalled)
    ticket, took = timed(adm.admit("a", 1, 1))
    assert (ticket.tenant, adm.inflight_by_tenant(), len(calls)) == ("a", {"a": 1}, 1)
    assert ACTOR_TIMEOUT_S <= took < ACTOR_TIMEOUT_S + 0.25
    ticket.done()
    assert adm.inflight_by_tenant() == {"a": 0}


# ---- API keys --------------------------------------------------------------------------------

def test_keys_from_env_and_file_are_kept_hashed(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# acme's keys\nsk-file-1\n\n  sk-file-2  \n")
    cfg = AppConfig.model_validate({"api_keys_env": "PDS_KEYS", "tenants": {"acme": {"api_keys_file": str(keys)}}})
    digests = load_key_digests(cfg, {"PDS_KEYS": "sk-env-1, sk-env-2"})
    adm = Admission(cfg, None, digests)
    assert [adm.authenticate(f"Bearer {k}") for k in ("sk-env-2", "sk-file-1", "sk-file-2")] == \
        ["default", "acme", "acme"]
    assert digests[key_digest("sk-env-1")] == "default"
    assert "sk-file-1" not in repr(vars(adm))  # only digests are held
    with pytest.raises(ValueError, match="environment variable 'PDS_KEYS' is not set"):
        load_key_digests(cfg, {})


@pytest.mark.parametrize("env, file, message", [
    ("", "sk-1\n", "api_keys_env: the environment variable 'PDS_KEYS' holds no key"),
    (" , \n ,", "sk-1\n", "api_keys_env: the environment variable 'PDS_KEYS' holds no key"),
    ("sk-1", "", "holds no key (one a line; # comments)"),
    ("sk-1", "# rotated out\n\n   \n", "holds no key (one a line; # comments)"),
])
def test_a_key_source_that_holds_no_key_refuses_to_start(tmp_path, env, file, message):
    """An empty key file or variable is not "no auth": the ingress refuses to start (it read such
    a source as configured keys, none of which matched, and ran with auth off)."""
    keys = tmp_path / "keys"
    keys.write_text(file)
    cfg = AppConfig.model_validate({"host": "0.0.0.0", "api_keys_env": "PDS_KEYS", "tenants": {
        "acme": {"api_keys_file": str(keys)}}})
    cfg.check_startable()  # the config names key sources: only reading them tells
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_key_digests(cfg, {"PDS_KEYS": env})


@pytest.mark.parametrize("options, field", [
    ({"api_keys": [""]}, "api_keys"), ({"api_keys": ["  "]}, "api_keys"),
    ({"tenants": {"a": {"api_keys": ["k"], "cache_group": ""}}}, "cache_group"),
])
def test_a_blank_key_or_an_empty_cache_group_is_refused_by_the_config(options, field):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate(options)


@pytest.mark.parametrize("header", ["Bearer ключ", "Bearer \ud800", "Bearer " + "k" * 600, "Bearer é"])
def test_a_strange_or_long_bearer_key_is_unauthenticated(header):
    adm = Admission(AppConfig(api_keys=["sk-1"]), None)
    with pytest.raises(ServingError) as e:
        adm.authenticate(header)
    assert e.value.code is Code.UNAUTHENTICATED


def test_an_open_non_loopback_bind_refuses_to_start():
    AppConfig().check_startable()  # loopback by default
    with pytest.raises(ValueError, match="'0.0.0.0' is not loopback and no API keys"):
        AppConfig(host="0.0.0.0").check_startable()
    AppConfig(host="0.0.0.0", allow_unauthenticated=True).check_startable()
    AppConfig(host="0.0.0.0", api_keys_file="/run/secrets/keys").check_startable()
    with pytest.raises(ValueError, match="tenant 'a' has no API keys"):
        AppConfig(tenants={"a": {"max_concurrent": 1}}).check_startable()


def test_engine_replicas_get_no_keys(tiny_model):
    from cluster.app.builder import build_app

    cfg = AppConfig.model_validate({
        "model": tiny_model, "api_keys": ["sk-inline"], "api_keys_env": "PDS_KEYS",
        "tenants": {"acme": {"api_keys": ["sk-acme"], "api_keys_file": "/k", "max_concurrent": 3}}})
    from ray.serve._private.build_app import build_app as serve_build

    deployments = {d.name: d for d in serve_build(build_app(cfg), name="pdserve").deployments}
    for pool in ("prefill", "decode"):
        args = deployments[pool].init_args[0]
        text = json.dumps(args)
        assert "sk-inline" not in text and "sk-acme" not in text and "PDS_KEYS" not in text and '"/k"' not in text
        engine_cfg = AppConfig.model_validate(args)
        assert engine_cfg.tenants["acme"].max_concurrent == 3 and not engine_cfg.has_keys
    assert AppConfig.model_validate(deployments["ingress"].init_args[0]).tenants["acme"].api_keys == ["sk-acme"]
