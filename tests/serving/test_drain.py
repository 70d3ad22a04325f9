"""Scale-down drains: the decode pool shrinks from 2 replicas to 1 (declarative deploy, so only
the pool's size changes) while 8 streams run; Serve stops routing to the removed replica and
gives its streams graceful_shutdown_timeout_s; what is still running then migrates. Every stream
ends identical to a failure-free greedy run, the surviving replica is the same one, and its
blocks come back."""

import pytest

from cluster.config import AppConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.serving.test_fault_tolerance import live_replicas, prompts, replica_load, request
from tests.helpers import grpc_stub, wait_until


def deploy(cfg: AppConfig, decode_replicas: int) -> None:
    """`serve deploy` of the app (the path deploy/serve.yaml takes): the code version hashes the
    import path and args, so changing only a deployment's num_replicas is a light update."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    serve_start().deploy_apps(ServeDeploySchema.model_validate({"applications": [{
        "name": "pdserve", "route_prefix": "/", "import_path": "cluster.app.builder:app_builder",
        "args": cfg.model_dump(mode="json"),
        "deployments": [{"name": "decode", "num_replicas": decode_replicas}]}]}), _blocking=True)


@pytest.fixture(scope="module")
def cluster(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, deploy=lambda cfg: deploy(cfg, 2), prefill={"num_replicas": 0},
                        decode={"num_replicas": 2}, health_check_period_s=1.0) as cfg, grpc_stub(cfg) as stub:
        yield cfg, stub


def test_scale_down_drains_and_every_stream_finishes_identical(cluster, tiny_model):
    cfg, stub = cluster
    wait_until(lambda: len(live_replicas("decode")) == 2, "both decode replicas report")
    before = set(live_replicas("decode"))
    ps = prompts(8, 24, base=700)
    expected = [o.token_ids for o in LLMEngine.from_model(tiny_model, num_blocks=256).generate(
        ps, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))]
    # Two waves: the second starts once the first is running (each has its first token), so
    # whichever chooses (the router, or Serve's own choice if the router call runs past its bound
    # on a loaded machine) sees four streams on one replica and none on the other. Sent at once,
    # all eight once landed on the replica Serve then kept, leaving nothing to drain.
    streams, got = [], []
    for wave in (ps[:4], ps[4:]):
        started = [iter(stub.Generate(request(p, 200), timeout=120)) for p in wave]
        got += [list(next(s).token_ids) for s in started]
        streams += started
    carried = {rid: replica_load("decode", rid)["running"] for rid in before}  # every stream has 199 to go
    assert sum(carried.values()) == len(ps)
    deploy(cfg, 1)
    for i, s in enumerate(streams):
        for r in s:
            got[i] += r.token_ids
    assert got == expected
    wait_until(lambda: len(live_replicas("decode")) == 1, "one decode replica left", timeout=30)
    [left] = live_replicas("decode")
    assert left in before  # the survivor kept running: a light update, not a restart
    [removed] = before - {left}
    assert carried[removed] >= 1  # the removed replica had streams to drain or migrate
    wait_until(lambda: (lambda s: s["free_blocks"] == 64 and s["running"] == s["waiting"] == 0)(
        replica_load("decode", left)), "the survivor's blocks are back")
