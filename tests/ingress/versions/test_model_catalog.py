"""Several models and versions, without Ray (issue 18): the `models` config and its refusals, manifests
resolved at deploy, the catalog's choice of version (split, sticky key, tenant override, pin, the
NOT_FOUND messages, live splits), the outcome recorder and the canary gate's arithmetic."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import Counter

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig
from cluster.manifest import ManifestError, build_manifest, resolve_manifests
from router.ingress.versions.catalog import ModelCatalog
from router.ingress.flow.request_flow import RequestFlow
from router.ingress.gateway.admission import Admission
from router.ingress.gateway.front_door import FrontDoor, local_quotas
from router.ingress.versions.rollout import Recorder, Rollouts, VersionStats
from router.ingress.status import Code, ServingError
from cluster.config.models import RolloutOptions

TWO = {"tiny": {"versions": {"v1": {"model": "A", "weight": 9}, "v2": {"model": "B", "weight": 1}}}}


@pytest.mark.parametrize("config, message", [
    ({"model": "x", "models": TWO}, "give either models or model/served_model_name/version, not both"),
    ({"models": {"tiny": {"versions": {}}}}, "versions\n  Dictionary should have at least 1 item"),
    ({"models": {"tiny": {"versions": {"v1": {"model": "A", "manifest": "m.yaml"}}}}},
     "give exactly one of model (a checkpoint directory) or manifest"),
    ({"models": {"tiny": {"versions": {"v1": {"model": "A", "weight": 0}}}}}, "weights must have a positive sum"),
    ({"models": {"tiny": {"versions": {"v 1": {"model": "A"}}}}}, "version label 'v 1': 1-64 characters"),
    ({"models": {"-x": {"versions": {"v1": {"model": "A"}}}}}, "model name '-x': 1-64 characters"),
    ({"models": {**TWO, "tiny-v1": {"versions": {"x": {"model": "A"}}}}}, None),
    ({"models": {"a-b": {"versions": {"c": {"model": "A"}}}, "a": {"versions": {"b-c": {"model": "A"}}}}},
     "two versions make the same deployment names"),
    ({"models": {"tiny": {**TWO["tiny"], "tenant_overrides": {"default": "v3"}}}},
     "tenant_overrides.default: unknown version 'v3' (known: ['v1', 'v2'])"),
    ({"models": {"tiny": {**TWO["tiny"], "tenant_overrides": {"acme": "v2"}}}},
     "models.tiny.tenant_overrides: unknown tenant 'acme'"),
    ({"models": {"tiny": {**TWO["tiny"], "shadow": {"version": "v9", "fraction": 0.1}}}},
     "shadow.version: unknown version 'v9'"),
    ({"models": {"tiny": {**TWO["tiny"], "shadow": {"version": "v2", "fraction": 1.5}}}},
     "Input should be less than or equal to 1"),
    ({"models": {"tiny": {**TWO["tiny"], "rollout": {"max_candidate_share": 0.05}}}},
     "the versions after the baseline take 10.0% of the traffic, over rollout.max_candidate_share 5.0%"),
])
def test_the_models_config_refuses_what_cannot_be_served(config, message):
    if message is None:
        AppConfig.model_validate(config)  # a model whose name looks like another's version: fine
        return
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(config)
    assert message in str(e.value)


def test_each_version_gets_its_own_pools_engine_and_sampling_defaults():
    cfg = AppConfig.model_validate({"engine": {"num_blocks": 64}, "default_max_tokens": 16, "models": {
        "tiny": {"versions": {"v1": {"model": "A"},
                              "v2": {"model": "B", "engine": {"num_blocks": 32}, "decode": {"num_replicas": 2},
                                     "sampling": {"temperature": 0.2, "max_tokens": 64}}}},
        "other": {"versions": {"main": {"model": "C", "prefill": {"num_replicas": 0}}}}}})
    got = [(v.name, v.label, v.deployments, v.config.serving_group, v.config.model, v.config.engine.num_blocks,
            v.config.decode.num_replicas, v.config.has_prefill_pool, v.config.default_max_tokens,
            v.sampling.overrides()) for v in cfg.served_versions()]
    assert got == [
        ("tiny", "v1", ("prefill-tiny-v1", "decode-tiny-v1"), "tiny@v1", "A", 64, 1, True, 16, {}),
        ("tiny", "v2", ("prefill-tiny-v2", "decode-tiny-v2"), "tiny@v2", "B", 32, 2, True, 64, {"temperature": 0.2}),
        ("other", "main", ("prefill-other-main", "decode-other-main"), "other@main", "C", 64, 1, False, 16, {})]
    single = AppConfig(model="A", served_model_name="m", version="r7")
    assert [(v.deployments, v.config.serving_group) for v in single.served_versions()] == [
        (("prefill", "decode"), "m@r7")]
    assert AppConfig(model="A").served_versions()[0].config.serving_group == "A"


def test_a_versions_sections_are_laid_over_the_apps_key_by_key():
    """A version's `engine`, `prefill` and `decode` (and a pool's `engine`) keep every key they do
    not set from the app-wide sections, at every level; a mapping value (resources) is replaced.
    (A version's `engine:` once replaced the app's whole: num_blocks 64 became the default.)"""
    cfg = AppConfig.model_validate({
        "engine": {"num_blocks": 64, "block_size": 32, "speculative": {"method": "ngram", "k": 2}},
        "prefill": {"num_cpus": 0.5, "engine": {"max_num_batched_tokens": 256}},
        "decode": {"num_cpus": 0.5, "resources": {"a": 1.0}},
        "models": {"tiny": {"versions": {
            "v1": {"model": "A"},
            "v2": {"model": "B", "engine": {"max_num_seqs": 8, "speculative": {"k": 6}},
                   "decode": {"num_replicas": 2, "resources": {"b": 2.0}, "engine": {"num_blocks": 128}}}}}}})

    def seen(c: AppConfig) -> list:
        return [(p, (e := c.engine_for(p)).num_blocks, e.block_size, e.max_num_seqs, e.max_num_batched_tokens,
                 e.speculative.method, e.speculative.k, getattr(c, p).num_replicas, getattr(c, p).num_cpus,
                 getattr(c, p).resources) for p in ("prefill", "decode")]

    v1, v2 = (v.config for v in cfg.served_versions())
    # defaults: max_num_seqs 64, max_num_batched_tokens 512
    assert seen(v1) == [("prefill", 64, 32, 64, 256, "ngram", 2, 1, 0.5, {}),
                        ("decode", 64, 32, 64, 512, "ngram", 2, 1, 0.5, {"a": 1.0})]
    assert seen(v2) == [("prefill", 64, 32, 8, 256, "ngram", 6, 1, 0.5, {}),
                        ("decode", 128, 32, 8, 512, "ngram", 6, 2, 0.5, {"b": 2.0})]
    # the ingress gets the app's config as a dump, a replica its version's: both read the same sections
    again = [v.config for v in AppConfig.model_validate(cfg.model_dump()).served_versions()]
    assert [seen(c) for c in again] == [seen(v1), seen(v2)]
    assert seen(AppConfig.model_validate(v2.without_keys().model_dump())) == seen(v2)
    assert cfg.model_dump()["models"]["tiny"]["versions"]["v2"]["engine"] == {"max_num_seqs": 8,
                                                                            "speculative": {"k": 6}}
    # a section that holds alone but not laid over the app's is refused, naming both
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 4}}, "models": {
            "tiny": {"versions": {"v1": {"model": "A", "decode": {"autoscaling": {"max_replicas": 1}}}}}}})
    assert "models.tiny.versions.v1.decode, laid over the app's decode: 1 validation error for AutoscalingOptions" \
           in str(e.value) and "max_replicas (1) must be >= min_replicas (3)" in str(e.value)


def test_a_manifest_versions_sections_go_between_the_apps_and_the_versions(tiny_model, tmp_path):
    """app < manifest < version, key by key (a version that set any engine key once lost the
    manifest's max_model_len, and both lost the app's engine)."""
    path = tmp_path / "v1.yaml"
    path.write_text(build_manifest(tiny_model, "tiny", "v1", max_model_len=256, engine={"max_num_seqs": 4},
                                   decode={"num_replicas": 2, "max_ongoing_requests": 8}).to_yaml())
    cfg = AppConfig.model_validate({"engine": {"num_blocks": 64}, "decode": {"num_cpus": 0.5}, "models": {"tiny": {
        "versions": {"v1": {"manifest": str(path), "engine": {"max_num_seqs": 6}, "decode": {"num_replicas": 3}}}}}})
    v1 = resolve_manifests(cfg).served_versions()[0].config
    e, d = v1.engine_for("decode"), v1.decode
    assert (e.num_blocks, e.max_model_len, e.max_num_seqs, d.num_replicas, d.max_ongoing_requests, d.num_cpus) == (
        64, 256, 6, 3, 8, 0.5)


def test_a_manifest_version_is_resolved_at_deploy_and_refused_when_its_files_changed(tiny_model, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    manifest = build_manifest(ckpt, "tiny", "v2", max_model_len=256, sampling={"top_k": 5},
                              decode={"num_replicas": 2})
    path = tmp_path / "v2.yaml"
    path.write_text(manifest.to_yaml())
    cfg = AppConfig.model_validate({"models": {"tiny": {"versions": {
        "v1": {"model": str(ckpt)}, "v2": {"manifest": str(path), "weight": 0}}}}})
    with pytest.raises(ValueError, match="models.tiny.versions.v2: its manifest is not resolved yet"):
        cfg.served_versions()
    v2 = resolve_manifests(cfg).served_versions()[1]
    assert (v2.config.model, v2.config.engine.max_model_len, v2.config.decode.num_replicas, v2.sampling.overrides()) == (
        str(ckpt.resolve()), 256, 2, {"top_k": 5})
    weights = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError) as e:
        resolve_manifests(cfg)
    assert str(e.value).startswith(f"models.tiny.versions.v2: manifest {path} does not hold: file {weights.name}: sha256")
    other = AppConfig.model_validate({"models": {"chat": {"versions": {"v1": {"manifest": str(path)}}}}})
    with pytest.raises(ManifestError, match=f"manifest {path} is for model 'tiny'"):
        resolve_manifests(other)


@pytest.fixture(scope="module")
def catalog(tiny_model, model_factory):
    v2 = model_factory("catalog-v2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512, seed=1)
    cfg = AppConfig.model_validate({"tenants": {"acme": {"api_keys": ["k-acme"]}}, "models": {
        "tiny": {"versions": {"v1": {"model": tiny_model, "weight": 9}, "v2": {"model": v2, "weight": 1}},
                 "tenant_overrides": {"acme": "v2"}, "shadow": {"version": "v2", "fraction": 0.5}},
        "other": {"versions": {"main": {"model": tiny_model}}}}})
    flows = {(v.name, v.label): RequestFlow(v.config, None, None) for v in cfg.served_versions()}
    return ModelCatalog.build(cfg, flows, random.Random(7))


def test_the_catalog_splits_pins_overrides_and_mirrors(catalog):
    picks = [catalog.select("tiny", "default", None) for _ in range(4000)]
    versions = Counter(r.assignment.version for r in picks)
    assert 300 <= versions["v2"] <= 500  # 10% of 4000 (binomial sd 19): 5 sd either side, seeded
    assert all(r.flow.config.version == r.assignment.version for r in picks)
    mirrored = Counter(r.shadow.config.version for r in picks if r.shadow is not None)
    assert set(mirrored) == {"v2"} and abs(mirrored["v2"] / versions["v1"] - 0.5) < 0.05  # only v1's are mirrored
    assert {catalog.select("tiny", "default", "s:alice").assignment.version for _ in range(50)} == {
        catalog.select("tiny", "default", "s:alice").assignment.version}
    assert {catalog.select("tiny", "acme", key).assignment for key in (None, "s:alice")} == {
        catalog.select("tiny", "acme", None).assignment}
    assert catalog.select("tiny", "acme", None).assignment.version == "v2"
    assert catalog.select("tiny", "acme", None).assignment.why == "tenant"
    pinned = catalog.select("tiny@v1", "acme", None)
    assert (pinned.assignment.version, pinned.assignment.why, pinned.shadow) == ("v1", "pinned", None)
    assert catalog.select(None, "default", None).flow.config.model_name == "tiny"  # no model: the first
    assert catalog.select("other", "default", None).flow.config.serving_group == "other@main"
    assert [m["id"] for m in catalog.model_info()] == ["tiny", "other"]


@pytest.mark.parametrize("model, message", [
    ("llama", "model 'llama' does not exist; this server serves 'tiny', 'other'"),
    ("tiny@v3", "model 'tiny' has no version 'v3' (versions: 'v1', 'v2')"),
    ("tiny@", "model 'tiny' has no version '' (versions: 'v1', 'v2')"),
    ("x" * 100_000, f"model {'x' * 64!r}... (100000 characters) does not exist; this server serves 'tiny', 'other'"),
    ("tiny@" + "v" * 65, f"model 'tiny' has no version {'v' * 64!r}... (65 characters) (versions: 'v1', 'v2')"),
])
def test_an_unknown_model_or_version_is_not_found(catalog, model, message):
    door = FrontDoor(catalog.config, catalog, {}, {}, Admission(catalog.config, local_quotas()))
    for call in (lambda: door.authorize("Bearer k-acme", model), lambda: catalog.select(model, "acme", None)):
        with pytest.raises(ServingError) as e:
            call()
        assert (e.value.code, e.value.message) == (Code.NOT_FOUND, message)


def test_live_splits_keep_the_overrides_and_the_salt(catalog):
    before = catalog.models["tiny"].policy
    try:
        catalog.apply(3, {"tiny": {"v1": 0.0, "v2": 1.0}})
        assert {catalog.select("tiny", "default", k).assignment.version for k in (None, "s:a", "s:b")} == {"v2"}
        assert catalog.models["tiny"].policy.tenant_overrides == before.tenant_overrides
        assert catalog.models["tiny"].policy.salt == before.salt == "tiny"
        assert catalog.generation == 3
    finally:
        catalog.apply(-1, {"tiny": dict(before.split)})
    assert catalog.models["tiny"].policy == before


class _D:
    def __init__(self, n: int, last: bool = False):
        self.completion_tokens, self.prompt_tokens, self.text = n, 4, "x"
        self.finish_reason = "length" if last else None


def test_the_recorder_counts_server_faults_only_and_times_first_tokens():
    now = [0.0]
    rec = Recorder(clock=lambda: now[0])

    async def deltas(n: int, error: ServingError | None = None):
        for i in range(1, n + 1):
            now[0] += 0.1 if i == 1 else 0.02
            yield _D(i, last=i == n and error is None)
        if error is not None:
            raise error

    async def run(n, error=None):
        try:
            async for _ in rec.observe(("tiny", "v2"), deltas(n, error)):
                pass
        except ServingError:
            pass

    asyncio.run(run(5))
    asyncio.run(run(1))
    asyncio.run(run(1, ServingError(Code.UNAVAILABLE, "decode failed")))  # an error, not a 1-token success
    asyncio.run(run(0, ServingError(Code.RESOURCE_EXHAUSTED, "overloaded")))  # not the version's fault: no sample
    asyncio.run(run(0, ServingError(Code.DEADLINE_EXCEEDED, "deadline")))  # the client's: no sample
    s = rec.drain()[("tiny", "v2")]
    assert (s.requests, s.errors, s.ttft_n, s.tpot_n, s.tokens, s.ttft_prompt_tokens) == (3, 1, 2, 1, 6, 8)
    assert s.ttft_s == pytest.approx(0.2) and s.tpot_s == pytest.approx(0.02)
    assert rec.drain() == {}


def _rollouts(**options):
    now = [1000.0]
    r = Rollouts(clock=lambda: now[0])
    r.configure({"chat": ({"base": 9.0, "canary": 1.0}, RolloutOptions(window_s=10, evaluate_s=1, min_requests=20,
                                                                        **options))})
    return r, now


def test_the_gate_rolls_back_a_canary_that_burns_its_error_budget_with_its_numbers():
    r, now = _rollouts()
    r.report({("chat", "base"): VersionStats(requests=100, errors=1), ("chat", "canary"): VersionStats(requests=19, errors=19)})
    assert r.splits() == {"chat": {"base": 9.0, "canary": 1.0}}  # 19 requests: not judged
    now[0] += 1
    [d] = r.report({("chat", "canary"): VersionStats(requests=1, errors=0)})
    assert d["action"] == "rollback" and r.splits() == {"chat": {"base": 1.0, "canary": 0.0}}
    assert d["reason"] == "gate: error rate 0.950 burns the budget (0.010) 95.0x (max 10x; baseline 0.010)"
    assert (d["canary"]["canary"]["requests"], d["canary"]["canary"]["errors"], d["baseline"]["base"]["errors"]) == (
        20, 19, 1)
    assert r.generation == 2 and [x["action"] for x in r.status()["decisions"]] == ["configured", "rollback"]


def test_the_gate_holds_when_the_baseline_fails_as_often_and_trips_on_latency():
    r, now = _rollouts()
    r.report({("chat", "base"): VersionStats(requests=40, errors=20), ("chat", "canary"): VersionStats(requests=40, errors=20)})
    assert r.splits()["chat"]["canary"] == 1.0  # as bad as the baseline: not the canary's doing
    now[0] += 11  # the window has passed: those reports are gone
    r.report({("chat", "base"): VersionStats(requests=40, ttft_s=4.0, ttft_n=40, ttft_prompt_tokens=4000),
              ("chat", "canary"): VersionStats(requests=40, ttft_s=13.0, ttft_n=40, ttft_prompt_tokens=4000)})
    assert r.status()["decisions"][-1]["reason"] == ("gate: mean TTFT per prompt token 3.2 ms is 3.2x the baseline's "
                                                     "1.0 ms (max 3x)")
    r, now = _rollouts(auto_rollback=False)
    [d] = r.report({("chat", "canary"): VersionStats(requests=30, errors=30)})
    assert d["action"] == "gate tripped (auto_rollback off)" and r.splits()["chat"]["canary"] == 1.0


def test_manual_splits_and_a_redeploy():
    r, _ = _rollouts()
    assert r.set_split("chat", {"canary": 1}, "all in")["weights"] == {"base": 0.0, "canary": 1.0}
    for bad, message in (({"beta": 1}, "model 'chat' has no version(s) ['beta'] (versions: ['base', 'canary'])"),
                         ({"base": 0}, "weights must be >= 0 with a positive sum, got {'base': 0}")):
        with pytest.raises(ValueError) as e:
            r.set_split("chat", bad, "x")
        assert str(e.value) == message
    capped, _ = _rollouts(max_candidate_share=0.25)  # blast radius: the canary may take a quarter at most
    assert capped.set_split("chat", {"base": 3, "canary": 1}, "canary to 25%")["weights"] == {"base": 3.0, "canary": 1.0}
    with pytest.raises(ValueError) as e:
        capped.set_split("chat", {"base": 1, "canary": 1}, "too far")
    assert str(e.value) == ("the versions after the baseline (base) would take 50.0% of chat's traffic, over "
                            "rollout.max_candidate_share 25.0%")
    assert capped.rollback("chat", "x")["weights"] == {"base": 1.0, "canary": 0.0}  # a rollback is always allowed
    with pytest.raises(ValueError, match=r"model 'code' does not exist \(models: \['chat'\]\)"):
        r.rollback("code", "x")
    r.configure({"chat": ({"base": 9.0, "canary": 1.0}, RolloutOptions())})  # another ingress, the same config
    assert r.splits() == {"chat": {"base": 0.0, "canary": 1.0}}  # the live split stays
    r.configure({"chat": ({"base": 1.0, "canary": 1.0}, RolloutOptions())})  # a redeploy with a new split
    assert r.splits() == {"chat": {"base": 1.0, "canary": 1.0}}
    assert r.rollback("chat", "drill")["weights"] == {"base": 1.0, "canary": 0.0}


def test_pinning_a_version_is_a_tenants_permission_and_no_sample_for_the_gate(tiny_model, model_factory):
    """Any tenant could pin `model@label` (a weight-0 or rolled-back version too) and feed the
    canary gate: one tenant could force a rollback for all. Now only a tenant with pin_versions may,
    and its pinned requests are not recorded."""
    import asyncio

    from router.ingress.request import ClientRequest, SamplingSpec
    from tests.helpers import front_door

    v2 = model_factory("catalog-v2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512, seed=1)
    cfg = AppConfig.model_validate({
        "tenants": {"acme": {"api_keys": ["k-acme"]}, "ops": {"api_keys": ["k-ops"], "pin_versions": True}},
        "models": {"tiny": {"versions": {"v1": {"model": tiny_model}, "v2": {"model": v2, "weight": 0}}}}})
    door = front_door(cfg)

    async def code(tenant: str, model: str) -> Code:
        try:
            await door.serve(ClientRequest(tenant, SamplingSpec(max_tokens=2), model=model, prompt="hi"))
        except ServingError as e:
            return e.code

    assert asyncio.run(code("acme", "tiny@v2")) is Code.PERMISSION_DENIED
    assert asyncio.run(code("acme", "tiny")) is Code.UNAVAILABLE  # past the front door: this test has no pools
    assert asyncio.run(code("ops", "tiny@v2")) is Code.UNAVAILABLE
    assert door.catalog.select("tiny@v2", "ops", None).recorder is None
    assert door.catalog.select("tiny", "ops", None).recorder is door.catalog.recorder


class _Prefill:
    """A version's prefill pool answering max_tokens=1 requests alone (token 7, no decode), each
    taking `ttft_s` on the test's clock."""

    def __init__(self, now: list[float], ttft_s: float):
        self.now, self.ttft_s = now, ttft_s
        self.prefill = self

    def options(self, **_):  # how a call travels (flow/legs.py `via`): one way here
        return self

    async def remote(self, rid, ids, sampling, ctx, target_replica=None):
        from prefill.result import PrefillResult

        self.now[0] += self.ttft_s
        return PrefillResult(rid, None, "length", first_token=7)


def test_a_pinned_tenant_cannot_roll_back_a_canary(tiny_model, model_factory):
    """A tenant pinning the canary with requests 100x slower than the baseline's trips nothing; the
    same requests sent to it by the split (here a tenant override) roll it back."""
    import asyncio

    from router.ingress.request import ClientRequest, SamplingSpec

    v2 = model_factory("catalog-v2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512, seed=1)
    cfg = AppConfig.model_validate({
        "tenants": {"ops": {"api_keys": ["k-ops"], "pin_versions": True}, "acme": {"api_keys": ["k-acme"]},
                    "beta": {"api_keys": ["k-beta"]}},
        "models": {"tiny": {"versions": {"v1": {"model": tiny_model}, "v2": {"model": v2}},
                            "tenant_overrides": {"acme": "v2", "beta": "v1"},
                            "rollout": {"min_requests": 20, "window_s": 60}}}})
    now = [0.0]
    door = FrontDoor.build(cfg, {"tiny@v1": (_Prefill(now, 0.01), None), "tiny@v2": (_Prefill(now, 1.0), None)})
    door.catalog.recorder = Recorder(clock=lambda: now[0])
    gate = Rollouts(clock=lambda: now[0])
    gate.configure(door.catalog.rollout_models())

    def send(tenant: str, model: str, served: str, n: int = 20) -> dict:
        """n requests (each its prefill's one token), then a sync: what the gate was sent."""
        async def one():
            reply = await door.serve(ClientRequest(tenant, SamplingSpec(max_tokens=1), model=model,
                                                   prompt_token_ids=(256, 1, 2, 3)))
            assert (reply.version, reply.choices[0].first.finish_reason) == (served, "length")
            assert [d async for d in reply.choices[0].stream] == []

        for _ in range(n):
            asyncio.run(one())
        now[0] += 1.0
        stats = door.catalog.recorder.drain()
        gate.report(stats)
        return {label: (s.requests, s.errors) for (_, label), s in stats.items()}

    assert send("beta", "tiny", "v1") == {"v1": (20, 0)}
    assert send("ops", "tiny@v2", "v2") == {}  # pinned: no sample, however slow
    assert gate.splits() == {"tiny": {"v1": 1.0, "v2": 1.0}}
    assert [d["action"] for d in gate.decisions] == ["configured"]
    assert send("acme", "tiny", "v2") == {"v2": (20, 0)}  # the split's traffic: judged
    assert gate.splits() == {"tiny": {"v1": 1.0, "v2": 0.0}}
    assert gate.decisions[-1]["reason"] == ("gate: mean TTFT per prompt token 250.0 ms is 100.0x the baseline's "
                                            "2.5 ms (max 3x)")


class _LeasingPrefill:
    """A prefill pool whose answers hold a lease for decode (token 7 first); releases are counted."""

    def __init__(self):
        self.prefill, self.released = self, []
        self.release = type("Release", (), {"remote": self._release})()

    def options(self, **_):  # how a call travels (flow/legs.py `via`): one way here
        return self

    async def remote(self, rid, ids, sampling, ctx, target_replica=None):
        from kv_transfer.handle import KVHandle, KVLayout
        from prefill.result import PrefillResult

        handle = KVHandle(rid, "prefill-1", "inc", "agent", (0, 1), (), len(ids), 7, KVLayout("fp", 16, "float32", 2, 2, 8),
                          0.0)
        return PrefillResult(rid, handle, None, first_token=7)

    async def _release(self, rid, target_replica=None):
        self.released.append(rid)


@pytest.mark.parametrize("versions, named", [
    ({"models": {"tiny": {"versions": {"v1": {"weight": 0}, "v2": {"weight": 1}}}}}, " (version tiny@v2)"),
    ({"served_model_name": "tiny", "version": "r7"}, " (version tiny@r7)"),
    ({"served_model_name": "tiny"}, ""),  # one model, no version label: nothing to tell apart
])
def test_a_version_failing_after_its_first_token_is_named_and_is_an_error_for_the_gate(tiny_model, versions,
                                                                                      named):
    """The issue's canary: its prefill answered (one token), its decode pool had no replica. The
    error names the version (both edges send its message), and the gate records an error, not a
    one-token success."""
    from router.ingress.request import ClientRequest, SamplingSpec

    if "models" in versions:
        for v in versions["models"]["tiny"]["versions"].values():
            v["model"] = tiny_model
    else:
        versions = {**versions, "model": tiny_model}
    cfg = AppConfig.model_validate(versions)
    prefill = _LeasingPrefill()
    door = FrontDoor.build(cfg, {v.config.serving_group: (prefill, None) for v in cfg.served_versions()})

    async def run() -> ServingError:
        reply = await door.serve(ClientRequest("default", SamplingSpec(max_tokens=4), model="tiny",
                                               prompt_token_ids=(256, 1, 2, 3)))
        assert reply.choices[0].first.token_ids == [7]
        with pytest.raises(ServingError) as e:
            async for _ in reply.choices[0].stream:
                pass
        return e.value

    error = asyncio.run(run())
    assert error.code is Code.UNAVAILABLE and error.replica_fault
    assert error.message.startswith("no decode replica: ")
    if named:
        assert error.message.endswith(named), error.message
    else:
        assert "(version" not in error.message, error.message
    assert len(prefill.released) == 1  # its lease, released: decode never took it
    recorded = {label: (s.requests, s.errors, s.tokens, s.ttft_n) for (_, label), s in door.catalog.recorder.drain().items()}
    assert recorded == ({"v2": (1, 1, 0, 0)} if "models" in versions else {})  # a model of one version has no gate
