"""deploy/ holds what a cluster runs, and none of it is imported by code, so these tests are its only
check: each file passes its tool's own validation where the tool is here (Ray's cluster-config
schema, Serve's config schema and app build), and the files agree with each other (the pools'
custom resources, the Serve config inside the RayService, what the Dockerfile copies)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster.app.builder import GRPC_EXPERIMENTS
from cluster.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
POOL_RESOURCE = {"prefill": "pdserve_prefill", "decode": "pdserve_decode"}


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_pdserve_yaml_is_the_default_config():
    assert AppConfig.from_yaml(DEPLOY / "pdserve.yaml") == AppConfig()


# ---- deploy/cluster.yaml ---------------------------------------------------------------------

def prepared_cluster_config(config: dict) -> dict:
    """What `ray up` checks before it calls the cloud: defaults merged in, then the JSON schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_rays_validation_with_one_worker_type_per_pool():
    config = prepared_cluster_config(load("cluster.yaml"))
    types = config["available_node_types"]
    assert (config["provider"]["type"], config["head_node_type"], set(types)) == ("azure", "head", {
        "head", "prefill", "decode"})
    assert types["head"]["resources"] == {"CPU": 16} and types["head"]["max_workers"] == 0
    for pool, resource in POOL_RESOURCE.items():
        t = types[pool]
        # one pool slot per GPU, and no other node type offers the pool's resource
        assert t["resources"][resource] == t["resources"]["GPU"] == 8
        assert [name for name, other in types.items() if resource in other["resources"]] == [pool]
        assert (t["min_workers"], t["max_workers"]) == (1, 4)
        assert t["node_config"]["azure_arm_parameters"]["vmSize"] == "Standard_ND96isr_H100_v5"
    assert sum(types[p]["max_workers"] for p in POOL_RESOURCE) == config["max_workers"]
    # every node installs pdserve with its GPU extra, from the working copy synced to it
    assert config["file_mounts"] == {"/home/ray/pdserve": "."}
    assert 'pip install -q -e "/home/ray/pdserve[gpu]"' in config["head_setup_commands"]
    assert 'pip install -q -e "/home/ray/pdserve[gpu]"' in config["worker_setup_commands"]
    # the dashboard runs jobs: loopback only (the launcher's tunnel reaches it), unless tokens are on
    [start] = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    assert "--dashboard-host=127.0.0.1" in start or "RAY_AUTH_MODE=token" in start


@pytest.mark.parametrize("break_it, error", [
    (lambda c: c["available_node_types"]["prefill"].update(min_worker=1), "Additional properties"),
    (lambda c: c["docker"].update(imagee="x"), "Additional properties"),
    (lambda c: c.update(head_node_type="gpu"), "`head_node_type` must be one of `available_node_types`"),
    (lambda c: c["available_node_types"]["decode"].pop("node_config"), "'node_config' is a required property"),
])
def test_rays_validation_catches_a_broken_cluster_yaml(break_it, error):
    config = load("cluster.yaml")
    break_it(config)
    with pytest.raises(Exception, match=re.escape(error)):
        prepared_cluster_config(config)


# ---- deploy/serve.yaml -----------------------------------------------------------------------

def test_serve_yaml_parses_with_serves_schema_and_builds_the_app(tiny_model, monkeypatch):
    from ray.serve._private.build_app import build_app  # the step `serve run` takes before deploying

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    from ray.serve.schema import ServeDeploySchema

    from cluster.app.builder import app_builder
    from ray.serve._private.utils import is_grpc_enabled

    schema = ServeDeploySchema.model_validate(load("serve.yaml"))
    assert not is_grpc_enabled(schema.grpc_options)  # the ingress replicas serve gRPC themselves
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8000)
    [app] = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("pdserve", "/", "cluster.app.builder:app_builder")

    args = AppConfig.model_validate(dict(app.args, model=tiny_model))
    assert (args.host, args.grpc_port, args.http_port) == ("0.0.0.0", 9000, 8000)
    built = build_app(app_builder(dict(app.args, model=tiny_model)), name=app.name)
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"ingress", "prefill", "decode"}
    assert deployments["ingress"].num_replicas == 2
    for pool, resource in POOL_RESOURCE.items():
        d = deployments[pool]
        assert d.ray_actor_options == {"num_cpus": 8.0, "num_gpus": 1.0, "resources": {resource: 1.0},
                                       "runtime_env": {"env_vars": {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}}}
        auto = d._deployment_config.autoscaling_config
        assert (auto.min_replicas, auto.max_replicas, auto.upscale_delay_s, auto.downscale_delay_s) == (2, 32, 0, 0)
        assert auto.policy.policy_function == "cluster.serving.autoscaling_policy:PoolAutoscalingPolicy"
        assert auto.policy.policy_kwargs["pool"] == pool
        assert auto.policy.policy_kwargs["options"] == getattr(args, pool).autoscaling.model_dump()
        assert AppConfig.model_validate(d.init_args[0]).model == tiny_model
    assert (args.prefill.autoscaling.target_ttft_s, args.decode.autoscaling.target_kv_usage) == (1.0, 0.8)
    cfg = AppConfig.model_validate(deployments["decode"].init_args[0])  # what the replicas are built from
    assert (cfg.engine_for("prefill").kv_cache_memory_gb, cfg.engine_for("decode").kv_cache_memory_gb) == (30, 50)
    assert cfg.kv_transfer.required_transports == ["rc"]


def test_each_pool_fits_the_nodes_of_its_type():
    """A replica's CPUs, GPUs and pool resource x the node's pool slots fit in that node type."""
    types = prepared_cluster_config(load("cluster.yaml"))["available_node_types"]
    [app] = load("serve.yaml")["applications"]
    for pool, resource in POOL_RESOURCE.items():
        p = AppConfig.model_validate(app["args"]).model_dump()[pool]
        node = types[pool]["resources"]
        slots = node[resource] / p["resources"][resource]
        assert slots == 8
        assert slots * p["num_gpus"] <= node["GPU"] and slots * p["num_cpus"] <= node["CPU"]


def test_config_errors_name_the_field():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="decode.num_replicas must be >= 1"):
        AppConfig(decode={"num_replicas": 0})
    with pytest.raises(pydantic.ValidationError, match="prefil"):
        AppConfig.model_validate({"prefil": {"num_replicas": 2}})
    with pytest.raises(pydantic.ValidationError, match="GPU is not a custom resource: use num_cpus / num_gpus"):
        AppConfig(decode={"resources": {"GPU": 1}})
    with pytest.raises(pydantic.ValidationError, match=r"decode.stream_interval\n  Value error, must be 'auto' or 1..64 tokens, got 0"):
        AppConfig(decode={"stream_interval": 0})
    assert (AppConfig().decode.stream_interval, AppConfig(decode={"stream_interval": 4}).decode.stream_interval) == ("auto", 4)


# ---- deploy/kuberay/rayservice.yaml ----------------------------------------------------------

def test_rayservice_carries_the_serve_yaml_app_and_one_worker_group_per_pool():
    service = load("kuberay/rayservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == load("serve.yaml")
    cluster = service["spec"]["rayClusterConfig"]
    import ray

    assert cluster["rayVersion"] == ray.__version__ and cluster["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == set(POOL_RESOURCE)
    launcher = prepared_cluster_config(load("cluster.yaml"))["available_node_types"]
    for pool, resource in POOL_RESOURCE.items():
        g = groups[pool]
        # KubeRay passes rayStartParams as strings; custom resources are a JSON object in a JSON string
        advertised = json.loads(json.loads(g["rayStartParams"]["resources"]))
        assert advertised == {resource: launcher[pool]["resources"][resource]}
        [container] = g["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == launcher[pool]["resources"]["GPU"] == advertised[resource]
        assert (g["minReplicas"], g["maxReplicas"]) == (launcher[pool]["min_workers"], launcher[pool]["max_workers"])
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in groups.values()]
    images = {c["image"] for spec in pods for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == {"pdserve:0.1.0"}
    model = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["model"]
    for spec in pods:  # every pod has the model where the app looks for it, before Ray starts
        [init] = spec["initContainers"]
        assert f"--local-dir {model}" in init["command"][-1]
        mounts = {m["mountPath"] for c in spec["containers"] for m in c["volumeMounts"]}
        assert "/models" in mounts and model.startswith("/models/")


# ---- deploy/Dockerfile -----------------------------------------------------------------------

def test_dockerfile_copies_every_package_pyproject_installs():
    import tomllib

    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages == ["nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04", "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"]
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M) for src in line.split()]
    assert all((ROOT / s).exists() for s in sources), sources
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= set(sources)
    assert 'pip install -q "/src[gpu]"' in text and '"flash-attn>=2.6"' in text
    assert "gpu" in pyproject["project"]["optional-dependencies"]


# ---- deploy/serve-models.yaml ----------------------------------------------------------------

def test_the_two_model_config_passes_serves_schema_and_builds_a_pool_pair_per_version(tiny_model, tmp_path):
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from cluster.app.builder import app_builder
    from cluster.manifest import build_manifest

    [app] = ServeDeploySchema.model_validate(load("serve-models.yaml")).applications
    args = dict(app.args)
    manifest = tmp_path / "v1.yaml"  # the checkpoints and the manifest, here: the tiny model
    manifest.write_text(build_manifest(tiny_model, "chat", "v1").to_yaml())
    chat, code = args["models"]["chat"], args["models"]["code"]
    chat["versions"]["v1"]["manifest"] = str(manifest)
    chat["versions"]["v2"]["model"] = code["versions"]["r3"]["model"] = tiny_model
    config = AppConfig.model_validate(args)
    assert {label: v.weight for label, v in config.models["chat"].versions.items()} == {"v1": 90.0, "v2": 10.0}
    built = build_app(app_builder(args), name=app.name)
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"ingress", "prefill-chat-v1", "decode-chat-v1", "prefill-chat-v2", "decode-chat-v2",
                                "decode-code-r3"}
    auto = {name: d._deployment_config.autoscaling_config for name, d in deployments.items()}
    assert (auto["decode-chat-v1"].min_replicas, auto["decode-chat-v1"].max_replicas) == (2, 16)
    assert (auto["decode-code-r3"].min_replicas, auto["decode-code-r3"].max_replicas) == (0, 4)
    assert auto["decode-chat-v2"] is None and deployments["decode-chat-v2"].num_replicas == 1  # the app's decode
    for name in ("decode-chat-v1", "decode-chat-v2", "decode-code-r3"):
        replica = AppConfig.model_validate(deployments[name].init_args[0])  # what the replicas are built from
        assert (Path(replica.model).resolve(), replica.models, replica.decode.resources) == (
            Path(tiny_model).resolve(), {}, {"pdserve_decode": 1.0})
    assert AppConfig.model_validate(deployments["decode-code-r3"].init_args[0]).serving_group == "code@r3"
