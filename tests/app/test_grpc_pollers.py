"""cluster/app/builder.py: every pdserve deployment's replicas run gRPC's pollers, not its
EventEngine (GRPC_EXPERIMENTS in their runtime_env), unless the environment that builds the app
says otherwise (no Ray: what the builder asks Serve for; the guardrail classifier's deployment
takes the same options)."""

from __future__ import annotations

import pytest

from cluster.app.builder import GRPC_EXPERIMENTS
from cluster.planner.runtime_actor import PLANNER_DEPLOYMENT
from tests.serving.test_tensor_parallel_config import built_deployments


@pytest.mark.parametrize("environment, passed", [(None, GRPC_EXPERIMENTS), ("", ""),
                                                 ("-event_engine_client", "-event_engine_client")])
def test_every_deployment_gets_the_pollers_or_the_builders_own_setting(tiny_model, monkeypatch, environment, passed):
    if environment is None:
        monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    else:
        monkeypatch.setenv("GRPC_EXPERIMENTS", environment)
    args = {"model": tiny_model, "mode": "disaggregated", "planner": {"enabled": True}}
    deployments = built_deployments(args)
    assert set(deployments) == {"ingress", "prefill", "decode", PLANNER_DEPLOYMENT}
    for name, d in deployments.items():
        assert d.ray_actor_options["runtime_env"] == {"env_vars": {"GRPC_EXPERIMENTS": passed}}, name


@pytest.mark.parametrize("job_env_vars, expected", [
    ({"PDSERVE_PROBE": "1"}, {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS, "PDSERVE_PROBE": "1"}),
    ({"GRPC_EXPERIMENTS": ""}, {"GRPC_EXPERIMENTS": ""}),  # the job's own setting wins
])
def test_the_replicas_keep_the_jobs_runtime_env(ray_session, job_env_vars, expected):
    """`serve.run` gives a deployment the job's runtime_env only when it has none of its own: the
    builder's carries the job's (here: a Ray task's, as a driver's job would be)."""
    import ray

    from cluster.app.builder import replica_runtime_env

    built = ray.get(ray.remote(num_cpus=0)(replica_runtime_env).options(
        runtime_env={"env_vars": job_env_vars}).remote(), timeout=60)
    assert built == {"env_vars": expected}
