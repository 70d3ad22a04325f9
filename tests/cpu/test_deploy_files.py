"""deploy/*.yaml parse with their schemas and build the app through the one builder."""

from pathlib import Path

import yaml

from cluster.app_config import AppConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_pdserve_yaml_is_the_default_config():
    assert AppConfig.from_yaml(DEPLOY / "pdserve.yaml") == AppConfig()


def test_serve_yaml_parses_with_serves_schema_and_builds_the_app(tiny_model):
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve_app import app_builder
    from router.ingress import GRPC_SERVICERS

    schema = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICERS
    [app] = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("pdserve", "/", "cluster.serve_app:app_builder")
    from ray.serve._private.build_app import build_app  # the step `serve run` takes before deploying

    built = build_app(app_builder(dict(app.args, model=tiny_model)), name=app.name)
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"ingress", "prefill", "decode"}
    for pool in ("prefill", "decode"):
        d = deployments[pool]
        assert (d.num_replicas, d.ray_actor_options["num_cpus"], d.ray_actor_options["num_gpus"]) == (1, 1.0, 0.0)
        assert AppConfig.model_validate(d.init_args[0]).model == tiny_model


def test_config_errors_name_the_field():
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="decode.num_replicas must be >= 1"):
        AppConfig(decode={"num_replicas": 0})
    with pytest.raises(pydantic.ValidationError, match="prefil"):
        AppConfig.model_validate({"prefil": {"num_replicas": 2}})
