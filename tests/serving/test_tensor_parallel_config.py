"""A pool's tensor_parallel_size in the app config (no Ray): what the builder asks Serve for (a
placement group of one bundle per rank), what the config refuses, and the KV handshake's refusal
of a tensor-parallel peer (KV transfer between tp pools is not implemented yet)."""

from __future__ import annotations

import pydantic
import pytest

from cluster.app.builder import GRPC_EXPERIMENTS
from cluster.config import AppConfig
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.handle import KVLayout
from tests.app.test_deploy_files import load


def deploy_config(model: str, **overrides) -> dict:
    """deploy/serve.yaml's app args (the example cluster's pools), colocated, with overrides per pool."""
    [app] = load("serve.yaml")["applications"]
    args = dict(app["args"], model=model, mode="colocated")
    for pool, keys in overrides.items():
        args[pool] = {**args[pool], **keys, "engine": {**args[pool]["engine"], **keys.get("engine", {})}}
    return args


def built_deployments(args: dict) -> dict:
    from ray.serve._private.build_app import build_app

    from cluster.app.builder import app_builder

    return {d.name: d for d in build_app(app_builder(args), name="pdserve").deployments}


def test_a_tp_pool_is_a_placement_group_of_one_bundle_per_rank(tiny_model, monkeypatch):
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    args = deploy_config(tiny_model, decode={"engine": {"tensor_parallel_size": 2}})
    d = built_deployments(args)["decode"]
    assert d.ray_actor_options == {"num_cpus": 8.0, "num_gpus": 1.0, "resources": {"pdserve_decode": 1.0},
                                   "runtime_env": {"env_vars": {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}}}
    config = d._replica_config
    assert config.placement_group_bundles == [{"CPU": 8.0, "GPU": 1.0, "pdserve_decode": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    assert config.placement_group_strategy == "STRICT_PACK"
    assert AppConfig.model_validate(d.init_args[0]).engine_for("decode").tensor_parallel_size == 2


def test_a_tp1_pool_has_no_placement_group_and_the_strategy_is_the_pools(tiny_model):
    args = deploy_config(tiny_model, decode={"placement_strategy": "PACK", "engine": {"tensor_parallel_size": 4}})
    d = built_deployments(args)["decode"]
    assert (len(d._replica_config.placement_group_bundles), d._replica_config.placement_group_strategy) == (4, "PACK")
    args = deploy_config(tiny_model)
    assert built_deployments(args)["decode"]._replica_config.placement_group_bundles is None


def test_cpus_needed_counts_every_rank():
    from cluster.app.builder import INGRESS_CPUS, cpus_needed

    tp3 = AppConfig(mode="colocated", model="m", decode={"num_replicas": 2, "num_cpus": 1.5,
                                                         "engine": {"tensor_parallel_size": 3}})
    assert (2 * 1.5 * 3 + INGRESS_CPUS, cpus_needed(tp3)) == (9.5, 10)  # two replicas of three ranks, ingress


def test_prefill_and_decode_pools_may_take_different_degrees():
    """KV moves between degrees (kv_transfer/rank_reads.py); a pair the model's KV heads cannot map
    is refused at the handshake (each degree is checked against the model when its engine starts)."""
    cfg = AppConfig(model="m", prefill={"engine": {"tensor_parallel_size": 2}},
                    decode={"engine": {"tensor_parallel_size": 1}})
    assert (cfg.engine_for("prefill").tensor_parallel_size, cfg.engine_for("decode").tensor_parallel_size) == (2, 1)
    assert AppConfig(model="m", decode={"engine": {"tensor_parallel_size": 2}}).engine_for("decode") \
        .tensor_parallel_size == 2


def test_a_tp_pool_without_resources_is_refused():
    with pytest.raises(pydantic.ValidationError, match=r"decode: tensor_parallel_size 2 needs num_cpus or num_gpus "
                       r"> 0 \(each rank's placement group bundle asks for them\)"):
        AppConfig(model="m", mode="colocated", decode={"num_cpus": 0, "engine": {"tensor_parallel_size": 2}})


def test_the_handshake_maps_degrees_and_refuses_what_cannot_map():
    tp1 = KVLayout("fp", 16, "float32", 2, 2, 16)  # num_kv_heads: the model's, whatever the degree
    tp1.check_compatible(KVLayout("fp", 16, "float32", 2, 2, 16, tensor_parallel_size=2), "engine p")
    with pytest.raises(IncompatiblePeerError) as e:
        tp1.check_compatible(KVLayout("fp", 16, "float32", 2, 2, 16, tensor_parallel_size=3), "engine p")
    assert str(e.value) == ("refusing KV from engine p: cannot map KV heads: the prefill pool's tensor_parallel_size 3 "
                            "neither divides the model's 2 KV heads nor is a multiple of them")

