"""Colocated mode (`mode: colocated`): no prefill pool, two decode replicas that prefill locally,
as a conventional server does. Same code and routing as the disaggregated app: output equals the
in-process engine, and a repeated prompt goes to the replica that cached its prefix."""

import concurrent.futures

import grpc
import pytest
import ray

from cluster.config import AppConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.kv_cache import extend_salt, hash_request_blocks
from cluster.engine.model.identity import model_identity
from cluster.tools.netutil import free_port
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import app_router, kill_app_actors, serve_replica_ids, wait_until


def live_replicas():
    return sorted(x.replica_id for x in ray.get(app_router().live_loads.remote()))


@pytest.fixture(scope="module")
def server(ray_session, tiny_model):
    from ray import serve

    import cluster.app.builder as serve_app

    cfg = AppConfig(
        mode="colocated", model=tiny_model, served_model_name="tiny", http_port=free_port(), grpc_port=free_port(),
        engine={"num_blocks": 64}, decode={"num_replicas": 2, "num_cpus": 0.5}, graceful_shutdown_timeout_s=1.0,
    )
    serve_app.start(cfg)
    # the router may still hold loads of an earlier module's replicas: wait for exactly ours
    decodes = serve_replica_ids()["decode"]
    assert len(decodes) == 2
    wait_until(lambda: live_replicas() == decodes, "the router to know exactly the two decode replicas")
    yield cfg
    serve.shutdown()
    kill_app_actors()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"localhost:{server.grpc_port}") as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)

    def run(prompt_ids, max_tokens):
        return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                            ignore_eos=True))[0].token_ids
    return run


def generate(stub, ids, max_tokens):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(stub.Generate(req, timeout=120))


def test_there_is_no_prefill_deployment(server):
    from ray import serve

    assert sorted(serve.status().applications["pdserve"].deployments) == ["decode", "ingress"]


def test_concurrent_streams_equal_the_in_process_engine(stub, reference):
    prompts = [[256] + [(i * 11 + j) % 250 for j in range(5 + 37 * i)] for i in range(8)]  # 6 .. 265 tokens

    def one(p):
        responses = generate(stub, p, 7)
        return [t for r in responses for t in r.token_ids], responses[-1].usage.prompt_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts))
    assert results == [(reference(p, 7), len(p)) for p in prompts]


def test_a_repeated_prompt_goes_to_the_replica_that_cached_its_prefix(stub, tiny_model):
    salt = extend_salt(model_identity(tiny_model).encode(), "")
    router = app_router()
    for s in range(3):  # by chance, a second request would find its prefix with probability 1/2 each time
        prefix = [256] + [(s * 31 + j) % 250 for j in range(63)]  # 4 blocks
        prompt = prefix + [1, 2, 3, 4, 5, 6]
        assert generate(stub, prompt, 2)[-1].usage.cached_prompt_tokens == 0
        hashes = set(hash_request_blocks(prefix, 16, salt))
        replicas = [x.replica_id for x in ray.get(router.live_loads.remote())]
        wait_until(lambda: any(hashes <= ray.get(router.hashes.remote(r)) for r in replicas),
                   "the prefix's blocks in the router's index")
        holders = [r for r in replicas if hashes <= ray.get(router.hashes.remote(r))]
        cached = generate(stub, prompt, 2)[-1].usage.cached_prompt_tokens
        decision, loads = ray.get(router.recent_decisions.remote())[-1]
        # a decision naming a holder with 0 cached: the call ran elsewhere (past the router's bound, or
        # Serve's request router gave the replica to another request); naming another: the policy's loads
        assert cached == 64, f"prefix on {holders}; routed by {decision} on loads {loads}"


def test_concurrent_calls_run_on_the_replica_each_names(server):
    """Serve's request router honours target_replica for every call of a burst: a replica chosen for
    one pending call is never handed to another (Serve's FIFO matching did that: in two runs under
    load, 3 and 4 of the 8 concurrent streams above ran on the replica the router had not chosen,
    and this burst failed at its second call)."""
    from ray import serve

    decodes = serve_replica_ids()["decode"]
    handle = serve.get_deployment_handle("decode", "pdserve")
    targets = [decodes[i % 2] for i in range(32)]
    before = {r: handle.load.remote(target_replica=r).result(timeout_s=30)["routed"] for r in decodes}
    calls = [handle.load.remote(target_replica=t) for t in targets]
    assert [c.result(timeout_s=60)["replica_id"] for c in calls] == targets
    after = {r: handle.load.remote(target_replica=r).result(timeout_s=30)["routed"] for r in decodes}
    # each replica counted its 16 calls (and the one that read `after`) on target, none off
    assert [(after[r]["on_target"] - before[r]["on_target"], after[r]["off_target"] - before[r]["off_target"])
            for r in decodes] == [(17, 0), (17, 0)]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate_in_colocated_mode(server, tiny_model, stream):
    """response_format on a replica that prefills its own prompts: even the random test model's
    output follows the schema (the grammar forces it), equal to the in-process engine's."""
    import json

    import jsonschema
    import openai

    from tests.engine.test_structured_output import COLOR, PERSON

    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    client = openai.OpenAI(base_url=f"http://localhost:{server.http_port}/v1", api_key="unused", max_retries=0)
    prompt = [256, 5, 6, 7]
    for name, schema in (("person", PERSON), ("color", COLOR)):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        kw = dict(model="tiny", prompt=prompt, max_tokens=64, temperature=0, extra_body={"response_format": fmt})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            reply = client.completions.create(**kw)
            text, finish = reply.choices[0].text, [reply.choices[0].finish_reason]
        [ref] = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0, response_format=(
            engine.validator.response_format("json_schema", schema, True))))
        assert (text, finish) == (engine.tokenizer.decode(ref.token_ids), ["stop"])
        jsonschema.validate(json.loads(text), schema)
