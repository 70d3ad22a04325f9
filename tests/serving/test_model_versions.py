"""Several models and versions behind one endpoint (issue 18), on a real cluster: model `tiny` has two
versions at 90/10 (same architecture, different weights, so a request whose prefill and decode ran
on two versions would show in its tokens, never in an error), each with its own prefill and decode
pools; model `other` has one version and no prefill pool. Every answer is checked token for token
against its version's in-process engine, and every pool is back at its totals afterwards."""

import concurrent.futures
import json
import math
import threading
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from router.traffic import TrafficPolicy
from tests.helpers import grpc_stub, http_base, pool_loads, serve_replica_ids, wait_for, wait_pools_whole

pytestmark = pytest.mark.ray

SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512)
PROMPT = [256] + list(range(1, 24))  # 24 tokens: past local_prefill_threshold, so prefilled remotely
MAX_TOKENS = 4
POOLS = {"v1": ("prefill-tiny-v1", "decode-tiny-v1"), "v2": ("prefill-tiny-v2", "decode-tiny-v2"),
         "main": ("decode-other-main",), "cand": ("decode-other-cand",)}


@pytest.fixture(scope="module")
def checkpoints(tiny_model, model_factory):
    return {"v1": tiny_model, "v2": model_factory("tiny-v2", seed=1, **SHAPE),
            "main": model_factory("other", seed=2, **SHAPE)}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Each version's greedy tokens for PROMPT, from the in-process engine (equal to transformers)."""
    out = {}
    for label, ckpt in checkpoints.items():
        engine = LLMEngine.from_model(ckpt, num_blocks=64)
        out[label] = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                              ignore_eos=True))[0].token_ids
    assert len({tuple(t) for t in out.values()}) == 3  # a mixed request could not pass for either version
    return out


@pytest.fixture(scope="module")
def server(serve_apps, checkpoints):
    models = {"tiny": {"versions": {"v1": {"model": checkpoints["v1"], "weight": 9},
                                    "v2": {"model": checkpoints["v2"], "weight": 1}}},
              # every request mirrored to `cand` (tiny-v2's weights under another name), which serves none
              "other": {"versions": {"main": {"model": checkpoints["main"], "prefill": {"num_replicas": 0}},
                                     "cand": {"model": checkpoints["v2"], "weight": 0, "prefill": {"num_replicas": 0}}},
                        "shadow": {"version": "cand", "fraction": 1.0}}}
    # replicas being replaced drain for up to 10 s (the tests' default, 1 s, kills the old ingress with
    # most streams in flight: Serve's proxy then answers INTERNAL "actor died")
    with serve_apps.run(None, models=models, routing={"local_prefill_threshold": 16},
                        graceful_shutdown_timeout_s=10.0) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def stub(server):
    with grpc_stub(server) as stub:
        yield stub


def generate(stub, model: str = "tiny", session: str | None = None) -> tuple[str, list[int]]:
    """(the version that served, the tokens) of one greedy request for PROMPT."""
    req = pb.GenerateRequest(model=model, token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    metadata = () if session is None else (("x-session-id", session),)
    responses = list(stub.Generate(req, metadata=metadata, timeout=60))
    assert [r.model_version for r in responses[1:]] == [""] * (len(responses) - 1)  # named once, first
    return responses[0].model_version, [t for r in responses for t in r.token_ids]


def binomial_bounds(n: int, p: float, alpha: float = 1e-6) -> tuple[int, int]:
    """The smallest interval [lo, hi] with P(X < lo) and P(X > hi) each below alpha / 2."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo = next(k for k in range(n + 1) if sum(pmf[: k + 1]) > alpha / 2)
    hi = next(k for k in range(n, -1, -1) if sum(pmf[k:]) > alpha / 2)
    return lo, hi


def wait_all_pools_whole(timeout: float = 30.0) -> None:
    wait_pools_whole(timeout, pools=tuple(d for pools in POOLS.values() for d in pools))


def test_a_90_10_split_over_400_requests_is_within_binomial_bounds_and_mixes_no_versions(stub, reference):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: generate(stub), range(400)))
    counts = Counter(version for version, _ in results)
    assert set(counts) == {"v1", "v2"}
    lo, hi = binomial_bounds(400, 0.1)  # [12, 76]
    assert lo <= counts["v2"] <= hi, counts
    mixed = [(v, tokens) for v, tokens in results if tokens != reference[v]]
    assert mixed == []  # every answer is its own version's, first token (prefill) and the rest (decode)
    loads = pool_loads(POOLS["v1"][1:] + POOLS["v2"][1:])
    assert loads["decode-tiny-v1"]["transfer"]["pulls_ok"] >= 1  # each version's decode pulled from its prefill
    assert loads["decode-tiny-v2"]["transfer"]["pulls_ok"] >= 1
    wait_all_pools_whole()


def test_a_sticky_key_keeps_its_version_and_keys_land_where_the_split_puts_them(stub, reference):
    policy = TrafficPolicy.of({"v1": 9, "v2": 1}, salt="tiny")  # the app's split for `tiny`

    def placed(key: str) -> str:  # the key as the catalog sees it: tenant-scoped, tagged by source (session.py)
        return policy.version_at(policy.point(f"default\ns:{key}"))

    assert {generate(stub, session="user-7")[0] for _ in range(50)} == {placed("user-7")}
    keys = [f"user-{i}" for i in range(60)]
    served = {k: generate(stub, session=k) for k in keys}
    assert {k: v for k, (v, _) in served.items()} == {k: placed(k) for k in keys}
    assert set(v for v, _ in served.values()) == {"v1", "v2"}
    assert all(tokens == reference[v] for v, tokens in served.values())
    wait_all_pools_whole()


def test_a_pinned_version_and_a_second_model(stub, reference):
    assert [generate(stub, model="tiny@v2") for _ in range(5)] == [("v2", reference["v2"])] * 5
    assert [generate(stub, model="other") for _ in range(3)] == [("main", reference["main"])] * 3
    assert generate(stub, model="")[0] in {"v1", "v2"}  # no model: the first one configured
    wait_all_pools_whole()


@pytest.mark.parametrize("model, message", [
    ("gpt-4", "model 'gpt-4' does not exist; this server serves 'tiny', 'other'"),
    ("tiny@v9", "model 'tiny' has no version 'v9' (versions: 'v1', 'v2')"),
])
def test_an_unknown_model_or_version_is_not_found_naming_what_exists(stub, server, model, message):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, model=model)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, message)
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(urllib.request.Request(f"{http_base(server)}/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=30)
    assert h.value.code == 404
    assert json.loads(h.value.read())["error"] == {"message": message, "type": "not_found_error", "param": None,
                                                   "code": "model_not_found"}


def test_the_listing_names_every_model_and_its_versions(stub, server):
    with urllib.request.urlopen(f"{http_base(server)}/v1/models", timeout=30) as r:
        data = json.loads(r.read())["data"]
    assert [(m["id"], m["versions"], m["max_model_len"]) for m in data] == [("tiny", ["v1", "v2"], 512),
                                                                            ("other", ["main", "cand"], 512)]
    listed = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    assert [(m.id, list(m.versions), m.version, m.vocab_size) for m in listed] == [
        ("tiny", ["v1", "v2"], "v1", 320), ("other", ["main", "cand"], "main", 320)]


def test_http_answers_name_their_version(server, reference):
    body = json.dumps({"model": "tiny@v2", "prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    req = urllib.request.Request(f"{http_base(server)}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        header, out = r.headers["x-pdserve-model-version"], json.loads(r.read())
    assert (header, out["model"], out["system_fingerprint"]) == ("v2", "tiny", "v2")
    streamed = json.dumps({"model": "other", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    req = urllib.request.Request(f"{http_base(server)}/v1/completions", streamed, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        header = r.headers["x-pdserve-model-version"]
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert header == "main"
    assert [(c["model"], c["system_fingerprint"]) for c in chunks] == [("other", "main")] * len(chunks)
    wait_all_pools_whole()


def shadow_outcomes(server) -> dict[str, float]:
    """The ingress's shadow counters for `other`'s candidate, by outcome, and its mirrors in flight."""
    with urllib.request.urlopen(f"{http_base(server)}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith('pdserve_ingress_shadow_inflight{model="other"} '):
            out["inflight"] = float(line.split()[-1])
        if line.startswith("pdserve_ingress_shadow_requests{"):
            labels, value = line[len("pdserve_ingress_shadow_requests{"):].split("} ")
            fields = dict(kv.split("=") for kv in labels.split(","))
            if (fields["model"], fields["version"]) == ('"other"', '"cand"'):
                out[fields["outcome"].strip('"')] = float(value)
    return out


def test_shadow_requests_never_reach_the_client_and_are_counted_apart(stub, server, reference):
    wait_for(lambda: shadow_outcomes(server)["inflight"] == 0, "no mirror of an earlier test still running")
    before, generated = shadow_outcomes(server), pool_loads(POOLS["cand"])["decode-other-cand"]["generation_tokens"]
    assert [generate(stub, model="other") for _ in range(6)] == [("main", reference["main"])] * 6
    want = {**before, "different": before.get("different", 0) + 6}  # the candidate answers otherwise, greedy
    assert before.get("shed", 0) == before.get("failed", 0) == 0  # no mirror shed or failed earlier either

    def settled():
        return shadow_outcomes(server) == want
    wait_for(settled, f"six mirrors settled as different (last: {shadow_outcomes(server)}, want {want})")
    assert pool_loads(POOLS["cand"])["decode-other-cand"]["generation_tokens"] - generated == 6 * MAX_TOKENS
    assert generate(stub, model="other@cand") == ("cand", reference["v2"])  # weight 0: served only when pinned
    wait_all_pools_whole()


def test_a_rolling_update_under_load_mixes_no_versions(server, reference):
    """Redeploy the app with v2's decode pool changed while four clients keep asking: Serve replaces
    the replicas (serve.run gives every deployment a new code version), one by one; every answer is
    still one version's own tokens, and a request caught by a replica going away ends with a status."""
    from cluster.app import builder
    from cluster.config import AppConfig

    raw = server.model_dump()
    raw["models"]["tiny"]["versions"]["v2"]["decode"] = {**raw["decode"], "max_ongoing_requests": 128}
    updated = AppConfig.model_validate(raw)
    results, stop = [], threading.Event()

    def client():
        with grpc_stub(server) as stub:
            while not stop.is_set():
                try:
                    results.append(generate(stub))
                except grpc.RpcError as e:
                    results.append(("error", (e.code(), e.details())))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(results) >= 20, "load running before the update", timeout=60)
        before = serve_replica_ids()
        builder.start(updated)  # returns once the app is RUNNING again
        deployed = len(results)
        wait_for(lambda: sum(v != "error" for v, _ in results[deployed:]) >= 20, "answers after the update", timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert serve_replica_ids()["decode-tiny-v2"] != before["decode-tiny-v2"]  # it was replaced
    answers = [(v, tokens) for v, tokens in results if v != "error"]
    assert [a for a in answers if a[1] != reference[a[0]]] == []  # not one mixed answer
    errors = Counter(error for v, error in results if v == "error")
    print(f"rolling update: {len(answers)} answers, errors {dict(errors)}")
    # Serve's own proxy answers INTERNAL "actor died ... killed by ray.kill" for a stream still open on
    # the old ingress when its drain ends (a request waiting for a replica of a pool being replaced
    # has no deadline here); every other failure must be one of pdserve's retryable statuses
    ours = {code for code, details in errors
            if not (code == grpc.StatusCode.INTERNAL and "ServeReplica:pdserve:ingress" in details
                    and "killed by `ray.kill`" in details)}
    assert ours <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED}, errors
    # A request whose old ingress was killed between its prefill and its decode leaves its prefill
    # lease to expire (kv_transfer.lease_s, 30 s): nobody pulls it. The pools are whole after that.
    wait_all_pools_whole(timeout=AppConfig().kv_transfer.lease_s + 15.0)
