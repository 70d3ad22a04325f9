"""Fuzzing the front door of a real `pdserve up`-style app (Serve, 1 prefill + 1 decode replica):
schemathesis over the HTTP API from the app's own OpenAPI schema (valid and invalid bodies), and
hypothesis over gRPC GenerateRequest messages and metadata. Bounded in examples and time.

Every response must be well formed (an error is the OpenAI error object, a gRPC failure a client
code with details), nothing may be a 5xx / server-side gRPC code, the server then still answers a
normal request with the reference tokens, and both pools return to their totals."""

import json
import time

import grpc
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, wait_pools_whole

HTTP_EXAMPLES = 150  # per operation and generation mode (6 operations, positive + negative)
GRPC_EXAMPLES = 2500
FUZZ = settings(deadline=None, database=None, derandomize=True, print_blob=False,
                suppress_health_check=list(HealthCheck))

ERROR_BODY = {  # the OpenAI error object every HTTP failure carries
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED}
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model):
    with serve_apps.run(  # a 64-token context bounds what a valid fuzzed request can cost
            tiny_model, served_model_name="tiny", engine={"num_blocks": 64, "max_model_len": 64},
            routing={"local_prefill_threshold": 16}) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    return engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids


def check_http(response) -> None:
    status = response.status_code
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: name -> values
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        jsonschema.validate(response.json(), ERROR_BODY)
        assert response.json()["error"]["message"]
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[:500]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    elif content_type.startswith("application/json"):
        response.json()


def test_http_api_fuzzed_from_its_openapi_schema(server):
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    from router.ingress.api.openai_api import app

    base = http_base(server)
    # the app's schema, from the code the server runs (the server itself serves none: /openapi.json is 404)
    schema = schemathesis.openapi.from_dict(app.openapi())
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in operations} >= {
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health")}
    session = requests.Session()
    started = time.monotonic()
    for op in operations:
        # an operation with no body and no parameters has no invalid form to generate
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(op.body) or op.query else [])
        for mode in modes:
            @settings(FUZZ, max_examples=HTTP_EXAMPLES)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                COUNTS["http"] = COUNTS.get("http", 0) + 1
                check_http(case.call(base_url=base, session=session, timeout=30))

            run()
    COUNTS["http_s"] = round(time.monotonic() - started, 1)
    print(f"\nfuzz: {COUNTS['http']} HTTP requests in {COUNTS['http_s']} s")


def sampling_params():
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from(
        [1e-38, 1e-45, -0.0, 0.0, 1e-6, 100.0, 3.4e38])
    return st.builds(
        pb.SamplingParams,
        max_tokens=st.none() | st.integers(0, 2**32 - 1) | st.integers(0, 70),
        temperature=st.none() | floats, top_p=st.none() | floats,
        top_k=st.none() | st.integers(-(2**31), 2**31 - 1),
        seed=st.none() | st.integers(-(2**63), 2**63 - 1),
        stop=st.lists(st.text(max_size=300), max_size=20),
        stop_token_ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 400), max_size=70),
        ignore_eos=st.booleans())


def generate_requests():
    prompt = st.one_of(
        st.builds(lambda t: {"text": t}, st.text(max_size=400)),
        st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
                  st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 330), max_size=80)),
        st.just({}))
    return st.builds(
        lambda p, sampling, model, rid, priority: pb.GenerateRequest(
            **p, sampling=sampling, model=model, request_id=rid, priority=priority),
        prompt, st.none() | sampling_params(), st.sampled_from(["", "tiny"]) | st.text(max_size=20),
        st.text(max_size=140), st.integers(-(2**31), 2**31 - 1))


metadata = st.lists(st.tuples(
    st.sampled_from(["authorization", "x-pdserve-timeout-s", "x-session-id", "x-other"]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60)),
    max_size=3, unique_by=lambda kv: kv[0])


def test_grpc_generate_fuzzed_with_hypothesis(server, reference):
    started = time.monotonic()
    with grpc_stub(server) as stub:

        @settings(FUZZ, max_examples=GRPC_EXAMPLES)
        @given(request=generate_requests(), md=metadata)
        def run(request, md):
            COUNTS["grpc"] = COUNTS.get("grpc", 0) + 1
            try:
                replies = list(stub.Generate(request, metadata=md, timeout=30))
            except grpc.RpcError as e:
                assert e.code() in CLIENT_CODES, (e.code(), e.details(), request, md)
                assert e.details()
                return
            assert replies and replies[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert sum(len(r.token_ids) for r in replies) == replies[-1].usage.completion_tokens

        run()
        COUNTS["grpc_s"] = round(time.monotonic() - started, 1)
        print(f"\nfuzz: {COUNTS['grpc']} gRPC requests in {COUNTS['grpc_s']} s")
        # still serving, with the reference output, and nothing leaked
        normal = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [t for r in stub.Generate(normal, timeout=60) for t in r.token_ids] == reference
    wait_pools_whole()
