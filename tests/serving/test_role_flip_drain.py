"""A replica's role flip without Serve: the real EngineReplica.set_role and the roles' calls over a
real engine, loop, reporter and roles (PrefillEngine, DecodeEngine); only the router (a recorder
answering each feed call with an object ref: the session's Ray) and the NIXL transport are
stand-ins (nothing is pulled). A drain reports at once, serves the calls already
coming, and is called off at its timeout with the role and the stream kept; a flip swaps the role
over the same engine; the other role's calls are refused before anything starts; a held lease
holds the flip back until it ends; a flip that names another replica is refused. The flip across real pools and NIXL: test_role_flip.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from cluster.config import AppConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.loop import EngineLoop
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import DrainTimeoutError, WrongReplicaError, WrongRoleError
from cluster.serving.replica_flip import RoleFlip
from cluster.serving.replica_role import PlayedRole
from cluster.serving.reporting import LoadReporter
from decode.deployment import DECODE_ROLE, DecodeServer
from decode.engine import DecodeEngine
from kv_transfer.notices import LeaseNotices
from kv_transfer.stats import TransferStats
from prefill.deployment import PREFILL_ROLE
from prefill.engine import PrefillEngine
from router.actor import router_name
from router.replies import ReplyLinks

PROMPT = [256] + list(range(1, 40))
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class Transport:
    """What the roles touch of a NIXL transport when no KV moves."""

    engine_id, incarnation, agent_name, host_num_blocks = "replica-x", "i1", "replica-x-i1", 0
    num_abandoned = unsent_notices = 0

    def __init__(self):
        self.stats = TransferStats()

    def lease_notices(self) -> LeaseNotices:
        return LeaseNotices([], [])

    def progress_notices(self) -> None: ...

    def send_notices(self) -> None: ...

    def poll_abandoned(self) -> list[int]:
        return []


class Router:
    """The router actor's feed, answered at once: every load reported, in order. Named as the app's
    one router (router/cells.py: one cell), so a flip keeps feeding it (RouterFeed.move: same name)."""

    def __init__(self, name: str):
        self.name = name
        self.loads = []
        self.feed = self

    def remote(self, replica_id, incarnation, seq, events, load, snapshot, changed_at):
        self.loads.append(load)
        return ray.put(True)


class Registry:
    def report(self, replica_id, stats): ...


class SlowRunner:
    """The real model runner, 3 ms slower a step: a 400-token stream outlives a 0.3 s drain."""

    def __init__(self, runner):
        self._runner = runner

    def execute(self, *args, **kwargs):
        time.sleep(0.003)
        return self._runner.execute(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._runner, name)


class Replica(DecodeServer):
    def __del__(self):  # EngineReplica's tells the router actor (Ray) it is gone
        self.loop.shutdown(timeout=5)


@pytest.fixture()
def replica(ray_session, tiny_model):
    """A decode replica (home: the decode deployment) that may play prefill, built as __init__ does
    without Serve, Ray or NIXL."""
    cfg = AppConfig(model=tiny_model, kv_transfer={"release_grace_s": 0.05})
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    engine.runner = SlowRunner(engine.runner)
    r = object.__new__(Replica)
    r.config, r.replica_id, r.engine, r.transport, r.faults = cfg, "replica-x", engine, Transport(), None
    r.routed = {"on_target": 0, "off_target": 0}
    r.played = PlayedRole({"prefill": PREFILL_ROLE, "decode": DECODE_ROLE}, "decode", engine, r.transport, cfg)
    router = Router(router_name("pdserve", cfg.serving_group))
    r.reporter = LoadReporter(engine, r.transport.stats, r.replica_id, "decode", Registry(), router)
    r.loop = EngineLoop(r.role, idle_poll_s=DECODE_ROLE.idle_poll_s, hooks=[r.reporter])
    r.flip = RoleFlip(r.replica_id, r.played, r.loop, r.reporter, "pdserve")
    r.replies = ReplyLinks("node-x")  # no call names an ingress's inbox here: outputs stream on the call
    return r


def reference(tiny_model, sampling):
    return LLMEngine.from_model(tiny_model, num_blocks=64).generate([PROMPT], sampling)[0].token_ids


async def tokens(stream, started: asyncio.Event | None = None) -> list[int]:
    got = []
    async for out in stream:
        got += out.token_ids
        if started is not None:
            started.set()
    return got


async def until(predicate, timeout=10.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def test_a_drain_past_its_timeout_is_called_off_and_serves_what_came_meanwhile(replica, tiny_model):
    router = replica.reporter.feed.router

    async def run():
        started = asyncio.Event()
        long = asyncio.create_task(tokens(replica.generate("long", PROMPT, LONG, None), started))
        await started.wait()
        flip = asyncio.create_task(replica.set_role("prefill", drain_timeout_s=0.3))
        await until(lambda: router.loads and router.loads[-1].draining)
        # a call routed before the drain was seen: served as before
        short = await tokens(replica.generate("short", PROMPT, SHORT, None))
        with pytest.raises(DrainTimeoutError, match="replica-x still held decode work after 0.3 s"):
            await flip
        assert not long.done()  # the stream outlived the drain
        return short, await long

    short, long = asyncio.run(run())
    assert (short, long) == (reference(tiny_model, SHORT), reference(tiny_model, LONG))
    assert any(ld.draining for ld in router.loads) and {ld.role for ld in router.loads} == {"decode"}
    last = router.loads[-1]
    assert (last.role, last.deployment, last.draining) == ("decode", "decode", False)
    assert (replica.role_name, type(replica.loop.core)) == ("decode", DecodeEngine)


def test_a_flip_swaps_the_role_over_the_same_engine_and_a_lease_holds_the_flip_back(replica, tiny_model):
    engine, router = replica.engine, replica.reporter.feed.router

    async def run():
        to_prefill = await replica.set_role("prefill")
        assert replica.loop.engine is engine and replica.role.engine is engine
        assert isinstance(replica.loop.core, PrefillEngine) and replica.loop.idle_poll_s == PREFILL_ROLE.idle_poll_s
        with pytest.raises(WrongRoleError, match="replica-x plays prefill now, not decode"):
            await tokens(replica.generate("refused", PROMPT, SHORT, None))
        assert await replica.set_role("prefill") == {**to_prefill, "drained_s": 0.0, "from": "prefill"}
        result = await replica.prefill("leased", PROMPT, LONG)
        assert result.handle is not None  # its blocks held for a decode engine
        back = asyncio.create_task(replica.set_role("decode", drain_timeout_s=10.0))
        await until(lambda: router.loads[-1].draining)
        await asyncio.sleep(0.2)
        assert not back.done()  # the lease holds it back
        await replica.release("leased")  # then its grace (0.05 s) ends
        return to_prefill, result, await back

    to_prefill, result, back = asyncio.run(run())
    assert {k: v for k, v in to_prefill.items() if k != "drained_s"} == {
        "replica_id": "replica-x", "from": "decode", "to": "prefill", "drained_requests": 0}
    assert {k: v for k, v in back.items() if k != "drained_s"} == {
        "replica_id": "replica-x", "from": "prefill", "to": "decode", "drained_requests": 1}
    assert back["drained_s"] >= 0.2
    assert result.first_token == reference(tiny_model, LONG)[0]
    assert [(ld.role, ld.deployment, ld.draining) for ld in router.loads[-1:]] == [("decode", "decode", False)]
    assert (replica.role_name, type(replica.loop.core)) == ("decode", DecodeEngine)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_flip_that_names_another_replica_is_refused_before_anything(replica, tiny_model):
    """Serve's request router sends a call whose target replica is gone to a live one: that one
    must not flip (the planner would count the wrong replica as moved)."""
    router = replica.reporter.feed.router

    async def run():
        with pytest.raises(WrongReplicaError) as refused:
            await replica.set_role("prefill", drain_timeout_s=10.0, target_replica="replica-gone")
        # still decoding: a stream is served after the refusal
        return str(refused.value), await tokens(replica.generate("after", PROMPT, SHORT, None))

    message, after = asyncio.run(run())
    assert message == ("set_role('prefill') named replica replica-gone but reached replica replica-x; "
                       "nothing was changed")
    assert after == reference(tiny_model, SHORT)
    assert [ld for ld in router.loads if ld.draining] == []  # no drain was reported
    assert (replica.role_name, type(replica.loop.core)) == ("decode", DecodeEngine)
    assert replica.routed == {"on_target": 0, "off_target": 1}
