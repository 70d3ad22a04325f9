"""Chaos tests on a real cluster (1 prefill + 2 decode replicas): a decode replica killed with 16
streams in flight (they migrate and finish identical to a failure-free run), a prefill replica
killed during prefill, dropped and stalled KV transfers (recompute), a slowed replica losing its
share, a stuck engine loop replaced by Serve's health check. After each: every live replica's
blocks back to their totals, the router's in-flight count at 0, nothing indexed for the dead."""

import concurrent.futures

import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import app_router, grpc_stub, inject_fault, wait_for, wait_until


@pytest.fixture(scope="module")
def cluster(serve_apps, tiny_model):
    with serve_apps.run(
        tiny_model,
        # prefill chunks of 16 tokens: a 40-token prompt takes 3 steps (a kill can land mid-prefill)
        prefill={"engine": {"num_blocks": 64, "max_num_batched_tokens": 16}}, decode={"num_replicas": 2},
        health_check_period_s=1.0, kv_transfer={"timeout_s": 1.0}, routing={"local_prefill_threshold": 16},
        fault_tolerance={"stuck_loop_s": 1.0, "fault_injection": True},
    ) as cfg, grpc_stub(cfg) as stub:
        yield stub


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=256)

    def run(prompts, max_tokens):
        return [o.token_ids for o in engine.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
    return run


def request(ids, max_tokens):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def handle(pool):
    from ray import serve

    return serve.get_deployment_handle(pool, "pdserve")


def live_replicas(pool) -> list[str]:
    loads = ray.get(app_router().live_loads.remote())
    return sorted(load.replica_id for load in loads if load.role == pool)


def replica_load(pool, replica_id) -> dict:
    return handle(pool).load.remote(target_replica=replica_id).result(timeout_s=30)


def kill(replica_id):
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def wait_whole_and_forgotten(dead=(), decodes=2, timeout=30.0):
    """Every live replica's blocks at their totals and queues empty; the router's in-flight count
    at 0; nothing indexed for the dead replicas. On a timeout the message names what was still off."""
    router = app_router()
    off = ["nothing read yet"]

    def whole():
        counts = {pool: live_replicas(pool) for pool in ("prefill", "decode")}
        if len(counts["decode"]) != decodes or len(counts["prefill"]) != 1:
            off[0] = f"live replicas {counts}"
            return False
        for pool, rids in counts.items():
            for rid in rids:
                s = replica_load(pool, rid)
                if s["replica_id"] != rid or not (s["free_blocks"] == s["total_blocks"] == 64 and s["running"]
                                                  == s["waiting"] == s["importing"] == s["held"] == 0):
                    off[0] = f"{pool} replica {rid} not whole: {s}"
                    return False
        pending = ray.get(router.pending_requests.remote())
        indexed = {rid: len(ray.get(router.hashes.remote(rid))) for rid in dead}
        off[0] = f"router pending {pending}, blocks indexed for the dead {indexed}, live {counts}"
        return pending == 0 and not any(indexed.values()) and not set(dead) & set(counts["decode"])

    try:
        wait_until(whole, "pools whole, router settled, dead replicas forgotten", timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {off[0]}") from None


def prompts(n, length, base=0):
    return [[256] + [(base + i * 13 + j) % 250 + 1 for j in range(length - 1)] for i in range(n)]


def test_killed_decode_replica_mid_stream_every_stream_migrates_and_finishes_identical(cluster, reference):
    """A killed decode replica loses the lease notices it had not sent yet (the "done" of a READ
    it completed): here all of the victim's are lost (injected). Its streams' leases still end
    when it dies, not at lease_s (30 s, past the bound below): the ingress releases them."""
    wait_until(lambda: len(live_replicas("decode")) == 2 and len(live_replicas("prefill")) == 1, "replicas report")
    victim = live_replicas("decode")[0]
    inject_fault(victim, "decode", notices="drop")
    ps = prompts(16, 24)
    expected = reference(ps, 160)
    calls = [cluster.Generate(request(p, 160), timeout=120) for p in ps]
    streams = [iter(c) for c in calls]
    got = [list(next(s).token_ids) for s in streams]  # every stream has started
    for i, s in enumerate(streams):
        got[i] += next(s).token_ids
    carried = replica_load("decode", victim)
    assert carried["running"] + carried["waiting"] + carried["importing"] >= 1  # streams to migrate
    kill(victim)
    for i, s in enumerate(streams):
        for r in s:
            got[i] += r.token_ids
    assert got == expected  # no token missing or repeated across the migration
    wait_whole_and_forgotten(dead=[victim], timeout=20.0)


def test_reply_connections_closed_mid_stream_every_stream_finishes_identical_on_its_serve_call(cluster, reference):
    """Decode outputs come to the ingress as frames on a socket of their own (router/replies.py).
    Each decode replica's connections closed mid-stream: every leg sends the rest on its Serve
    call (from its first token; the ingress drops what it had), once, and ends identical."""
    decodes = live_replicas("decode")
    legs = {rid: replica_load("decode", rid)["reply_legs"] for rid in decodes}
    warm = iter(prompts(64, 24, base=300))

    def framed_everywhere():  # a replica's first call from this ingress connects: the later ones are framed
        list(cluster.Generate(request(next(warm), 2), timeout=30))
        return all(replica_load("decode", rid)["reply_legs"]["framed"] > legs[rid]["framed"] for rid in decodes)

    wait_for(framed_everywhere, "a framed leg on every decode replica", 30)
    for rid in decodes:
        inject_fault(rid, "decode", step_delay_s=0.03)  # 64 tokens: ~2 s streams
    try:
        before = {rid: replica_load("decode", rid)["reply_legs"] for rid in decodes}
        ps = prompts(8, 24, base=400)
        expected = reference(ps, 64)
        streams = [iter(cluster.Generate(request(p, 64), timeout=120)) for p in ps]
        got = [list(next(s).token_ids) + list(next(s).token_ids) for s in streams]  # decoding, every one
        for rid in decodes:
            inject_fault(rid, "decode", close_replies=True)
        for i, s in enumerate(streams):
            for r in s:
                got[i] += r.token_ids
    finally:
        for rid in decodes:
            inject_fault(rid, "decode", step_delay_s=0.0)
    assert got == expected  # no token missing or repeated across the switch
    after = {rid: replica_load("decode", rid)["reply_legs"] for rid in decodes}
    delta = {k: sum(after[r][k] - before[r][k] for r in decodes) for k in ("framed", "streamed", "fell_back")}
    assert delta == {"framed": 8, "streamed": 0, "fell_back": 8}
    wait_whole_and_forgotten()


def test_killed_prefill_replica_during_prefill_requests_complete(cluster, reference):
    [victim] = live_replicas("prefill")
    inject_fault(victim, "prefill", step_delay_s=0.5)  # 3 chunked steps of 0.5 s per prompt: time to kill
    ps = prompts(4, 40, base=100)
    expected = reference(ps, 12)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lambda p: [t for r in cluster.Generate(request(p, 12), timeout=120)
                                          for t in r.token_ids], p) for p in ps]
        wait_for(lambda: replica_load("prefill", victim)["running"] > 0, "a prefill part-way through its prompt")
        kill(victim)
        assert [f.result(timeout=120) for f in futures] == expected  # prefilled on decode instead
    wait_whole_and_forgotten(dead=[victim])


@pytest.mark.parametrize("fault, counter", [("drop", "pulls_failed"), ("stall", "pulls_timed_out")])
def test_dropped_or_stalled_transfer_is_recomputed_to_the_reference(cluster, reference, fault, counter):
    decodes = live_replicas("decode")
    for rid in decodes:
        inject_fault(rid, "decode", pull=fault)
    before = {rid: replica_load("decode", rid)["transfer"] for rid in decodes}
    ps = prompts(3, 48, base=200 + len(fault))  # 47 uncached tokens >= 16: prefilled remotely, pulled
    try:
        outs = [[t for r in cluster.Generate(request(p, 10), timeout=60) for t in r.token_ids] for p in ps]
    finally:
        for rid in decodes:
            inject_fault(rid, "decode", pull="none")
    assert outs == reference(ps, 10)
    after = {rid: replica_load("decode", rid)["transfer"] for rid in decodes}
    assert sum(after[r][counter] - before[r][counter] for r in decodes) == 3
    assert sum(after[r]["fallbacks_recompute"] - before[r]["fallbacks_recompute"] for r in decodes) == 3
    wait_whole_and_forgotten()


def test_a_replica_slowed_three_times_gets_fewer_new_requests(cluster):
    fast, slow = live_replicas("decode")

    def served():
        return {rid: replica_load("decode", rid)["generation_tokens"] for rid in (fast, slow)}

    def settled():
        loads = ray.get(app_router().live_loads.remote())
        return ray.get(app_router().pending_requests.remote()) == 0 and all(
            load.running == load.waiting == 0 for load in loads)

    def run(n, base):  # short prompts: prefilled on the decode replica the router picks
        for p in prompts(n, 8, base=base):
            wait_until(settled, "the router has the replicas' reports after the last request")
            list(cluster.Generate(request(p, 4), timeout=60))

    def direct(rid, name, base):  # straight to one replica (its deployment handle, target_replica)
        gen = handle("decode").options(stream=True).generate.remote(
            name, prompts(1, 8, base=base)[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
            None, target_replica=rid)
        assert [o.finished for o in gen][-1]

    for i, rid in enumerate((fast, slow)):  # past the replicas' warm-up steps: step times are measured
        direct(rid, f"warm-{i}", 300 + i)
    inject_fault(slow, "decode", step_delay_s=0.05)  # the tiny model steps in a few ms: this is >> 3x
    direct(slow, "slowed", 320)  # it steps slowly and reports so

    def step_times():
        return {load.replica_id: load.step_time_s for load in ray.get(app_router().live_loads.remote())}

    # its smoothed step time (over ~10 steps) is now >= 3x the other's: reported, the router sees it
    wait_until(lambda: step_times()[slow] >= 3 * step_times()[fast] > 0, "the slow replica's step time is reported")
    before = served()
    try:
        run(12, 340)
    finally:
        inject_fault(slow, "decode", step_delay_s=0.0)
    after = served()
    share = (after[slow] - before[slow]) / sum(after[r] - before[r] for r in (fast, slow))
    # one request at a time on an idle pool, decided on settled reports: the slow replica's cost
    # (0 x 4 + 1) loses to the fast one's (0) every time
    assert share == 0.0
    wait_whole_and_forgotten()


def test_stuck_engine_loop_fails_health_and_the_replica_is_replaced(cluster, reference):
    stuck = live_replicas("decode")[0]
    inject_fault(stuck, "decode", stall_loop_s=30.0)  # stuck_loop_s is 1 s; Serve checks every second
    wait_until(lambda: stuck not in live_replicas("decode") and not ray.get(app_router().hashes.remote(stuck)),
               "the stuck replica is dropped", timeout=30)
    p = prompts(1, 20, base=400)
    assert [[t for r in cluster.Generate(request(p[0], 6), timeout=60) for t in r.token_ids]] == reference(p, 6)
    wait_whole_and_forgotten(dead=[stuck], timeout=60)  # Serve starts a replacement


POISON = 255  # no prompt here holds it: prompts() draws from 1..250


def test_a_poison_request_fails_only_its_prefill_replica_and_is_not_redone_on_decode(cluster):
    """Poison containment (issue 52): the prefill replica's forward raises on a prompt holding the
    poison token; the request ends INTERNAL naming itself and the replica, and no decode replica
    runs it (it used to be prefilled again on decode: a second replica hit)."""
    import re

    replicas = {pool: live_replicas(pool) for pool in ("prefill", "decode")}
    errors_before = {(p, r): replica_load(p, r)["step_errors"] for p, rs in replicas.items() for r in rs}
    received = {key: replica_load(*key)["requests_received"] for key in errors_before}
    for (pool, rid) in errors_before:
        inject_fault(rid, pool, poison_token=POISON)
    try:
        [ids] = prompts(1, 40, base=7)
        ids[5] = POISON  # in the first 16-token chunk
        with pytest.raises(Exception) as e:
            list(cluster.Generate(request(ids, 8), timeout=60))
    finally:
        for (pool, rid) in errors_before:
            inject_fault(rid, pool, poison_token=-1)
    assert e.value.code().name == "INTERNAL"
    assert re.fullmatch(
        r"request [0-9a-f]{32}: the forward holding it failed on prefill replica \S+ after 0 tokens \(engine step "
        rf"failed: PoisonError: fault injection: the forward's input holds poison token {POISON}\); not retried on "
        r"another replica, as it may be what made the forward fail", e.value.details()), e.value.details()
    loads = {key: replica_load(*key) for key in errors_before}
    assert {key: (load["requests_received"] - received[key], load["step_errors"] - errors_before[key])
            for key, load in loads.items()} == {key: (1, 1) if key[0] == "prefill" else (0, 0) for key in loads}
    wait_whole_and_forgotten()
