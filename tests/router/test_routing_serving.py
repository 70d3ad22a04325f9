"""Prefix-aware routing in the serving cluster (2 prefill + 1 decode replicas): shared prefixes go
where they are cached; a killed prefill replica leaves the index; a killed router degrades to
Serve's own choice and recovers, and a session keeps its replicas across the router's restart."""

import time

import grpc
import pytest
import ray

from protos.pdserve.v1 import generation_pb2 as pb
from cluster.engine.kv_cache import hash_request_blocks
from cluster.engine.model.identity import model_identity
from router.policy import SessionHint
from tests.helpers import app_router, grpc_stub, http_base, serve_replica_ids, wait_until


SYSTEMS = [[256] + [(s * 31 + j) % 250 for j in range(63)] for s in range(2)]  # 4 blocks each


SALT = b""
KEY = "sk-test-1"


class Authed:
    """The stub with this app's API key on every call (the app has auth on)."""

    def __init__(self, stub, cfg):
        self.stub, self.cfg = stub, cfg

    def Generate(self, req, timeout):  # noqa: N802
        return self.stub.Generate(req, timeout=timeout, metadata=[("authorization", f"Bearer {KEY}")])


@pytest.fixture(scope="module")
def cluster(serve_apps, tiny_model):
    global SALT
    SALT = model_identity(tiny_model).encode()  # the engines' block-hash salt
    with serve_apps.run(tiny_model, prefill={"num_replicas": 2}, routing={"local_prefill_threshold": 16},
                        api_keys=[KEY]) as cfg:  # its own app: the module kills a prefill replica
        with grpc_stub(cfg) as stub:
            yield Authed(stub, cfg)


def generate(stub, prompt, max_tokens=2):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(stub.Generate(req, timeout=60))[-1]


def router_state():
    router = app_router()
    stats = ray.get(router.stats.remote())
    loads = ray.get(router.live_loads.remote())
    return stats, {load.replica_id: load.role for load in loads}




def test_shared_prefixes_go_where_they_are_cached(cluster):
    wait_until(lambda: sorted(router_state()[1].values()) == ["decode", "prefill", "prefill"],
             "all three replicas report to the router")
    for s in SYSTEMS:  # warm-up: each prefix is prefilled once somewhere
        generate(cluster, s + [1] * 32)
    prefills = [r for r, pool in router_state()[1].items() if pool == "prefill"]

    def on_a_prefill_replica(system):
        held = set().union(*(ray.get(app_router().hashes.remote(r)) for r in prefills))
        return set(hash_request_blocks(system, 16, SALT)) <= held

    wait_until(lambda: all(on_a_prefill_replica(s) for s in SYSTEMS), "each prefix is indexed on a prefill replica")
    cached = []
    for i in range(10):
        s = SYSTEMS[i % 2]
        last = generate(cluster, s + [(i * 7 + j) % 250 for j in range(32)])  # 32 new tokens: remote
        cached.append(last.usage.cached_prompt_tokens)
    hit_rate = sum(cached) / (64 * len(cached))
    assert hit_rate >= 0.9, cached


def channel_calls() -> tuple[int, int]:
    """(calls the router served on its channel, decisions it made) since it started."""
    router = app_router()
    return ray.get(router.channel_calls.remote()), ray.get(router.stats.remote()).decisions


def test_the_ingress_routes_over_the_routers_channel(cluster):
    """Every request's route call is a call on the router's channel (router/channel.py), not a Ray
    actor call: once the ingress has connected, each decision the router makes came over it."""
    prompt = SYSTEMS[1] + [7] * 32
    wait_until(lambda: (generate(cluster, prompt), channel_calls()[0] > 0)[1], "the ingress's channel is up")
    before = channel_calls()
    for i in range(3):
        assert generate(cluster, SYSTEMS[1] + [8, i] + [9] * 30).finish_reason == pb.FINISH_REASON_LENGTH
    after = channel_calls()
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3)


def test_a_session_stays_on_its_replicas_over_grpc_and_http(cluster):
    """Cold prompts (nothing cached anywhere) of one session: load alone would alternate the
    prefill replicas (the router counts its pending work); the session's bonus keeps them on
    the replica of its first request. Over gRPC metadata and the HTTP header alike."""
    import json
    import urllib.request

    auth = [("authorization", f"Bearer {KEY}")]

    def cold(i):  # 48 tokens whose first block no other test sends: cached nowhere
        return [256, 255, 254, 253, i] + [(i * 13 + j) % 250 for j in range(43)]

    def grpc_turn(i):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=cold(i)),
                                 sampling=pb.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        list(cluster.stub.Generate(req, timeout=60, metadata=auth + [("x-session-id", "conv-1")]))

    def http_turn(i):
        body = json.dumps({"prompt": cold(i), "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{http_base(cluster.cfg)}/v1/completions", data=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {KEY}", "x-session-id": "conv-2"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200

    for turn in (grpc_turn, http_turn):
        for i in range(4):
            turn(i + (100 if turn is http_turn else 0))
        decisions = [d for d, _ in ray.get(app_router().recent_decisions.remote())[-4:]]
        assert all(d.mode == "remote" for d in decisions), [d.reason for d in decisions]
        assert len({d.prefill for d in decisions}) == 1, [d.reason for d in decisions]
        assert all(f"session kept on {decisions[0].prefill}" in d.reason for d in decisions[1:])
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Generate(pb.GenerateRequest(text="hi"), timeout=30,
                                   metadata=auth + [("x-session-id", "conv 1")]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-session-id" in e.value.details()


def test_a_second_app_serving_the_same_model_keeps_its_own_routing_state(cluster):
    """Another Serve app with a decode replica of this model (the same serving group) beside this
    one: its replica feeds its app's router only; this app's router never sees it, and this app's
    requests are routed among this app's replicas, their blocks indexed by this app's router only."""
    from ray import serve

    from cluster.app.builder import engine_config
    from decode.deployment import DecodeServer
    from router.actor import kill_app_actors, lookup, router_name

    other_app = "pdserve-other"
    serve.run(serve.deployment(DecodeServer, name="decode", ray_actor_options={"num_cpus": 0.5}).bind(
        engine_config(cluster.cfg), None), name=other_app, route_prefix=None)
    try:
        [theirs] = serve_replica_ids(other_app)["decode"]
        name = router_name(other_app, cluster.cfg.serving_group)
        wait_until(lambda: lookup(name) is not None and [x.replica_id for x in ray.get(
            lookup(name).live_loads.remote())] == [theirs], "the other app's replica reports to its own router")
        ours = serve_replica_ids()
        assert sorted(router_state()[1]) == sorted(ours["prefill"] + ours["decode"])
        last = generate(cluster, SYSTEMS[0] + [3] * 32)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        decision, loads = ray.get(app_router().recent_decisions.remote())[-1]
        assert theirs not in {decision.prefill, decision.decode, *(x.replica_id for x in loads)}
        stats = ray.get(lookup(name).stats.remote())
        assert (stats.replicas, stats.tracked_blocks, stats.decisions) == (1, 0, 0)
    finally:
        serve.delete(other_app)
        kill_app_actors(other_app)


def test_killed_prefill_replica_leaves_the_index_and_requests_keep_flowing(cluster):
    _, replicas = router_state()
    victim = sorted(r for r, pool in replicas.items() if pool == "prefill")[0]
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(victim)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    t_kill = time.monotonic()
    # Whichever comes first: Serve's health check (every 2 s for engine pools) notices the death and
    # the ingress's request router drops the replica, or the router finds it silent for 3 s.
    wait_until(lambda: victim not in router_state()[1] and not ray.get(app_router().hashes.remote(victim)),
             "the dead replica is forgotten", timeout=9.0)
    assert time.monotonic() - t_kill < 9.0
    last = generate(cluster, SYSTEMS[0] + [5] * 32)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    for i in range(4):
        assert generate(cluster, SYSTEMS[1] + [i] * 32).finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", KEY)]])
def test_api_key_required_over_grpc(cluster, metadata):
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Generate(pb.GenerateRequest(text="hi"), timeout=30, metadata=metadata))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")


def test_api_key_required_over_http(cluster):
    import json
    import urllib.error
    import urllib.request

    url = f"{http_base(cluster.cfg)}/v1/completions"
    body = json.dumps({"prompt": [256, 1], "max_tokens": 2}).encode()
    for headers, status in (({}, 401), ({"authorization": "Bearer nope"}, 401),
                            ({"authorization": f"Bearer {KEY}"}, 200)):
        req = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                code = resp.status
        except urllib.error.HTTPError as err:
            code = err.code
            assert json.loads(err.read())["error"]["type"] == "authentication_error"
        assert code == status


def router_pid() -> int:
    import os

    return ray.get(app_router().__ray_call__.remote(lambda self: os.getpid()))


def test_killed_router_degrades_to_serves_choice_and_recovers(cluster):
    """Killed under requests: none fails, none misses its cached prefix while the router is away,
    and routing quality comes back within a bound: both
    shared prefixes are routed to where they are cached ("cache" decisions) and hit there. The
    bound is loose for a shared 2-core runner; the figure is the routing bench's
    `--kill-router-after` (docs/benchmarks.md, "A router killed under load")."""
    policy = ray.get(app_router().policy_settings.remote())
    assert policy[1] == "cost" and policy[0].local_prefill_threshold == 16  # the app's, not the default 64
    before = router_pid()
    killed_at = time.monotonic()
    ray.kill(app_router(), no_restart=False)  # Ray restarts it empty
    # served while the router restarts and relearns, each on the prefill replica that holds the
    # system prompt: the ingress remembers where the prefix went (Serve's own choice, the fallback
    # without that memory, picks one of the two prefill replicas at random)
    during = [generate(cluster, SYSTEMS[0] + [120 + i] * 32) for i in range(3)]  # suffixes no other test sends
    assert [(d.finish_reason, d.usage.cached_prompt_tokens) for d in during] == [(pb.FINISH_REASON_LENGTH, 64)] * 3
    wait_until(lambda: router_pid() != before, "the router restarted")
    assert ray.get(app_router().policy_settings.remote()) == policy  # configured before the restart
    wait_until(lambda: router_state()[0].replicas >= 2, "the replicas resync the restarted router")
    wait_until(lambda: (generate(cluster, SYSTEMS[1] + [6] * 32), channel_calls()[0] > 0)[1],
               "the ingress finds the restarted router's channel")

    polls = iter(range(1000))

    def both_prefixes_routed_to_their_cache() -> bool:
        n = next(polls)  # a fresh suffix each poll: only the system prompt's 4 blocks can be cached
        prompts = [s + [200 + n % 50, j] + [(n * 11 + k) % 250 for k in range(30)] for j, s in enumerate(SYSTEMS)]
        hits = [generate(cluster, p).usage.cached_prompt_tokens for p in prompts]
        decisions = [d for d, _ in ray.get(app_router().recent_decisions.remote())[-2:]]
        return hits == [64, 64] and [(d.reason, d.predicted_cached_tokens) for d in decisions] == [("cache", 64)] * 2

    wait_until(both_prefixes_routed_to_their_cache, "routing by cache again after the restart", timeout=20)
    assert time.monotonic() - killed_at < 20


def test_a_session_keeps_its_replicas_across_a_router_restart(cluster):
    """Ray restarts a killed router with an empty session table; the ingress's route call carries
    the replicas it last saw chosen for the session, and the new router adopts them: the session's
    next turn (a cold prompt, so its prefix cannot decide) lands on the same prefill and decode
    replicas, by the session's bonus, and the restarted router's table holds the session again."""
    key = "default\ns:conv-restart"  # the routing key: tenant (this API key's), then the tagged session

    def turn(i):
        prompt = [256, 254, 252, 250, i] + [(i * 17 + j) % 250 for j in range(43)]  # first block sent by no other test
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        list(cluster.stub.Generate(req, timeout=60, metadata=[("authorization", f"Bearer {KEY}"),
                                                              ("x-session-id", "conv-restart")]))
        return ray.get(app_router().recent_decisions.remote())[-1][0]

    def table():
        return ray.get(app_router().__ray_call__.remote(lambda self: self.sessions.peek(key, self.clock())))

    wait_until(lambda: sorted(router_state()[1].values()) == ["decode", "prefill", "prefill"],
               "all three replicas report to the router")
    before = [turn(i) for i in range(2)]
    kept = table()
    assert [SessionHint(d.prefill, d.decode) for d in before] == [kept] * 2 and kept.decode is not None
    pid = router_pid()
    ray.kill(app_router(), no_restart=False)  # Ray restarts it with an empty table
    wait_until(lambda: router_pid() != pid, "the router restarted")
    assert table() is None
    # all three again: with one prefill replica known the policy has no choice to keep (nor a reason to name it)
    wait_until(lambda: sorted(router_state()[1].values()) == ["decode", "prefill", "prefill"],
               "all three replicas report to the restarted router")
    after = turn(2)
    assert (after.mode, after.prefill, after.decode) == ("remote", kept.prefill, kept.decode)
    assert f"session kept on {kept.prefill}" in after.reason, after.reason  # the bonus, not a tie
    assert table() == kept and ray.get(app_router().stats.remote()).sessions == 1
