"""Runtime role flips on real pools (issue 42): 2 prefill replicas and 1 decode replica of the tiny
model. While four greedy streams wait on their KV pulls (decode's READs stalled until the drain has
begun), the prefill replica that holds some of their leases is flipped to decode through the
prefill deployment's handle: it drains (decode pulls their KV, the leases end), then decodes from
the same process and engine, reached through the prefill deployment. Every stream equals the
in-process engine's tokens, none failed, none migrated or fell back to local prefill; new requests
then decode on the flipped replica; it flips back; every replica's blocks are whole. A drain past
its timeout is called off: the replica keeps its role and its stream. The drain's mechanics
without Ray: test_role_flip_drain.py."""

from __future__ import annotations

import threading

import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import DrainTimeoutError, WrongRoleError
from tests.helpers import app_router, grpc_stub, inject_fault, serve_replica_ids, wait_for, wait_until
from tests.serving.test_tensor_parallel_serving import request

NUM_BLOCKS = 128  # four streams of ~100 + 240 tokens fit one decode replica without preemption
MAX_TOKENS = 240


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, engine={"num_blocks": NUM_BLOCKS}, prefill={"num_replicas": 2},
                        decode={"num_replicas": 1}, fault_tolerance={"fault_injection": True}) as cfg, \
            grpc_stub(cfg) as stub:
        wait_until(lambda: sorted(r.role for r in live()) == ["decode", "prefill", "prefill"], "replicas report")
        yield stub


def handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, "pdserve")


def load(deployment: str, replica: str) -> dict:
    return handle(deployment).load.remote(target_replica=replica).result(timeout_s=30)


def live():
    return ray.get(app_router().live_loads.remote())


def roles() -> dict[str, tuple[str, str, bool]]:
    """replica -> (the pool it plays, its home deployment, draining), as the router sees them."""
    return {r.replica_id: (r.role, r.deployment, r.draining) for r in live()}


def prompts(n: int, base: int) -> list[list[int]]:
    # 96 .. 126 tokens: past routing.local_prefill_threshold (64), so each is prefilled on the prefill pool
    return [[256] + [(base + i * 17 + j * 7) % 250 + 1 for j in range(95 + 10 * i)] for i in range(n)]


def reference(model: str, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in LLMEngine.from_model(model, num_blocks=256).generate(ps, sp)]


class Streams:
    """Greedy gRPC streams, each consumed on its own thread."""

    def __init__(self, stub, ps: list[list[int]], max_tokens: int):
        self.got: list[list[int]] = [[] for _ in ps]
        self.errors: list[BaseException] = []

        def consume(i: int) -> None:
            try:
                for r in stub.Generate(request(ps[i], max_tokens), timeout=120):
                    self.got[i].extend(r.token_ids)
            except BaseException as e:  # noqa: BLE001 — asserted by the test
                self.errors.append(e)
        self.threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(ps))]
        for t in self.threads:
            t.start()

    def join(self) -> list[list[int]]:
        for t in self.threads:
            t.join(timeout=120)
        assert not self.errors, self.errors
        return self.got


def whole(replicas: dict[str, str]) -> None:
    """Every replica (id -> home deployment) back at its block total, nothing queued or leased; the
    router's in-flight count at 0."""
    seen = {}

    def check() -> bool:
        seen.update({r: load(home, r) for r, home in replicas.items()})
        return all(s["free_blocks"] == s["total_blocks"] == NUM_BLOCKS and s["running"] == s["waiting"]
                   == s["importing"] == s["held"] == 0 for s in seen.values()) and ray.get(
            app_router().pending_requests.remote()) == 0

    wait_until(check, f"every replica whole (last seen: {seen})", timeout=30)


@pytest.mark.timeout(240)
def test_a_prefill_replica_flips_to_decode_mid_stream_and_back(app, tiny_model):
    ids = serve_replica_ids()
    prefills, [d] = ids["prefill"], ids["decode"]
    homes = {**{p: "prefill" for p in prefills}, d: "decode"}
    before = {r: load(home, r) for r, home in homes.items()}
    # decode's READs never complete until the flip's drain has begun, so the victim still holds
    # leases when it drains. Without it the flip raced decode's pulls: a prefill replica's load is
    # answered between engine turns, and by the time the test had read it and sent the flip, decode
    # had pulled every prompt in a few ms (a fresh-clone CI run: drained_requests 0, twice, with
    # prefill steps slowed to 0.3 s and then to 1.5 s)
    inject_fault(d, "decode", pull="stall", step_delay_s=0.02)  # 240 tokens: ~5 s streams after the pulls

    ps = prompts(4, base=0)
    expected = reference(tiny_model, ps, MAX_TOKENS)
    wave = Streams(app, ps, MAX_TOKENS)
    held: dict[str, int] = {}

    def leased() -> bool:  # every prompt prefilled and held under a lease (decode's READs stall)
        held.update({p: load("prefill", p)["held"] for p in prefills})
        return sum(held.values()) == len(ps)
    wait_for(leased, "every prompt prefilled and leased", timeout=60)
    victim = max(held, key=held.get)
    [other] = [p for p in prefills if p != victim]

    flipping = handle("prefill").set_role.remote("decode", drain_timeout_s=30.0, target_replica=victim)
    wait_until(lambda: roles()[victim][2], f"replica {victim} drains", timeout=30)
    inject_fault(d, "decode", pull="none")  # well inside the pulls' timeout_s (10 s): none falls back
    flip = flipping.result(timeout_s=60)
    try:
        assert {k: flip[k] for k in ("replica_id", "from", "to")} == {"replica_id": victim, "from": "prefill",
                                                                        "to": "decode"}
        assert flip["drained_requests"] == held[victim] >= 1 and flip["drained_s"] > 0, flip
        assert max(len(g) for g in wave.got) < MAX_TOKENS  # the streams still run
        assert roles() == {victim: ("decode", "prefill", False), other: ("prefill", "prefill", False),
                           d: ("decode", "decode", False)}
        flipped = load("prefill", victim)
        assert (flipped["role"], flipped["deployment"], flipped["pid"]) == ("decode", "prefill", before[victim]["pid"])
        assert flipped["steps"] >= before[victim]["steps"] and flipped["transfer"]["leases_granted"] >= 1  # same engine
        with pytest.raises(WrongRoleError, match=f"replica {victim} plays decode now, not prefill"):
            handle("prefill").prefill.remote("refused", ps[0], SamplingParams(max_tokens=4, temperature=0),
                                             target_replica=victim).result(timeout_s=30)

        assert wave.join() == expected
        after = {r: load(home, r) for r, home in homes.items()}
        received = {r: after[r]["requests_received"] - before[r]["requests_received"] for r in homes}
        # one prefill and one decode leg a stream: no migration (a second leg), no local prefill fallback
        assert (received[d], received[victim] + received[other]) == (len(ps), len(ps)), received
        pulled = after[d]["transfer"]["pulls_ok"] - before[d]["transfer"]["pulls_ok"]
        assert (pulled, after[d]["transfer"]["fallbacks_recompute"]) == (len(ps), 0)
        assert [after[p]["transfer"]["leases_expired"] for p in prefills] == [0, 0]

        # new requests decode on the flipped replica too (reached through the prefill deployment)
        for r, home in homes.items():
            inject_fault(r, home, step_delay_s=0.0)
        ps2 = prompts(4, base=101)
        assert Streams(app, ps2, 32).join() == reference(tiny_model, ps2, 32)
        decoded = load("prefill", victim)
        assert (decoded["transfer"]["pulls_ok"] >= 1
                and decoded["requests_received"] > after[victim]["requests_received"])

        back = handle("prefill").set_role.remote("prefill", target_replica=victim).result(timeout_s=60)
        assert {k: back[k] for k in ("replica_id", "from", "to", "drained_requests")} == {
            "replica_id": victim, "from": "decode", "to": "prefill", "drained_requests": 0}
        assert roles() == {victim: ("prefill", "prefill", False), other: ("prefill", "prefill", False),
                           d: ("decode", "decode", False)}
        assert load("prefill", victim)["pid"] == before[victim]["pid"]
        whole(homes)
    finally:  # a failure above leaves the module as the next test expects it: no fault, roles at home
        for r, home in homes.items():
            inject_fault(r, home, pull="none", step_delay_s=0.0)
        if roles().get(victim, ("prefill",))[0] == "decode":
            handle("prefill").set_role.remote("prefill", drain_timeout_s=60.0, target_replica=victim).result(
                timeout_s=90)


@pytest.mark.timeout(120)
def test_a_drain_past_its_timeout_is_called_off_and_the_stream_goes_on(app, tiny_model):
    [d] = serve_replica_ids()["decode"]
    inject_fault(d, "decode", step_delay_s=0.02)
    ps = prompts(1, base=211)
    stream = Streams(app, ps, MAX_TOKENS)
    wait_for(lambda: len(stream.got[0]) >= 3 or stream.errors, "the stream decodes", timeout=60)
    with pytest.raises(DrainTimeoutError, match=f"replica {d} still held decode work after 0.5 s"):
        handle("decode").set_role.remote("prefill", drain_timeout_s=0.5, target_replica=d).result(timeout_s=30)
    assert roles()[d] == ("decode", "decode", False)
    assert stream.join() == reference(tiny_model, ps, MAX_TOKENS)
    inject_fault(d, "decode", step_delay_s=0.0)
    assert load("decode", d)["role"] == "decode"
    whole({**{p: "prefill" for p in serve_replica_ids()["prefill"]}, d: "decode"})
