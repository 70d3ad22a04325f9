"""The serving cluster on Ray Serve (1 prefill + 1 decode replica): gRPC, OpenAI HTTP, errors,
cancellation and deadlines, with both pools' blocks checked after every lifecycle."""

import concurrent.futures
import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, pool_loads, wait_pools_whole


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, served_model_name="tiny", routing={"local_prefill_threshold": 16}) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def stub(server):
    with grpc_stub(server) as stub:
        yield stub


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)

    def run(prompt_ids, max_tokens=8):
        return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                            ignore_eos=True))[0]
    return run


def request(ids, max_tokens=8, **sampling):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0), ignore_eos=True, **sampling))


def test_grpc_stream_equals_in_process_and_is_incremental(stub, reference):
    prompt = [256] + list(range(1, 40))
    responses = list(stub.Generate(request(prompt, max_tokens=12), timeout=60))
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == reference(prompt, 12).token_ids
    assert len(responses) >= 2 and len(responses[0].token_ids) == 1  # the first token comes alone, first
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    loads = wait_pools_whole()
    assert loads["decode"]["transfer"]["pulls_ok"] >= 1  # the KV came from the prefill pool


def test_a_short_prompt_is_prefilled_on_decode(stub, reference):
    before = pool_loads()["decode"]["transfer"]["pulls_ok"]
    prompt = [256, 3, 1, 4, 1, 5, 9, 2]  # 8 uncached tokens < the threshold of 16
    responses = list(stub.Generate(request(prompt, max_tokens=5), timeout=60))
    assert [t for r in responses for t in r.token_ids] == reference(prompt, 5).token_ids
    assert pool_loads()["decode"]["transfer"]["pulls_ok"] == before  # no KV transfer
    wait_pools_whole()


def test_sixteen_concurrent_streams(stub, reference):
    prompts = [[256] + [(i * 7 + j) % 250 for j in range(3 + 5 * i)] for i in range(16)]

    def one(p):
        return [t for r in stub.Generate(request(p, max_tokens=6), timeout=120) for t in r.token_ids]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, prompts))
    assert results == [reference(p, 6).token_ids for p in prompts]
    wait_pools_whole()


def test_second_request_hits_the_prefill_prefix_cache(stub):
    prompt = [256] + [(j * 3) % 250 for j in range(70)]
    list(stub.Generate(request(prompt, max_tokens=2), timeout=60))
    last = list(stub.Generate(request(prompt, max_tokens=2), timeout=60))[-1]
    assert last.usage.cached_prompt_tokens == 64


def test_list_models_and_health(stub, server):
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert [(m.id, m.max_model_len, m.vocab_size) for m in models.models] == [("tiny", 512, 320)]
    with grpc.insecure_channel(f"localhost:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    base = http_base(server)
    with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:
        assert (resp.status, json.loads(resp.read())) == (200, {"status": "serving", "model": "tiny",
                                                               "models": ["tiny"]})
    with urllib.request.urlopen(f"{base}/version", timeout=30) as resp:
        assert json.loads(resp.read()) == {"version": "0.1.0", "model": "tiny", "mode": "disaggregated",
                                              "models": {"tiny": []}}
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "pdserve_ingress_inflight 0.0" in text and 'pdserve_ingress_info{model="tiny",version="0.1.0"} 1.0' in text


@pytest.mark.parametrize(
    "req, code, details",
    [
        (pb.GenerateRequest(text=""), "INVALID_ARGUMENT", "prompt: must be a non-empty string"),
        (pb.GenerateRequest(), "INVALID_ARGUMENT", "prompt: set text, token_ids or chat"),
        (request([5] * 512, 1), "INVALID_ARGUMENT",
         "prompt: has 512 tokens; the context length is 512, so at most 511 fit"),
        (request([5] * 500, 13), "INVALID_ARGUMENT",
         "max_tokens: prompt (500 tokens) + max_tokens (13) = 513 exceeds the context length 512"),
        (request([5, 6], 0), "INVALID_ARGUMENT", "max_tokens: must be >= 1, got 0"),
        (request([5, 6], 4_000_000_000), "INVALID_ARGUMENT",
         "max_tokens: prompt (2 tokens) + max_tokens (4000000000) = 4000000002 exceeds the context length 512"),
        (request([5, 6], 4, temperature=math.nan), "INVALID_ARGUMENT", "temperature: must be a finite number, got nan"),
        (request([5, 6], 4, temperature=-1.0), "INVALID_ARGUMENT", "temperature: must be in [0.0, 100.0], got -1.0"),
        (request([5, 6], 4, top_p=1.5), "INVALID_ARGUMENT", "top_p: must be in (0.0, 1.0], got 1.5"),
        (request([5, 6], 4, top_k=-2), "INVALID_ARGUMENT", "top_k: must be >= 0, got -2"),
        (request([5, 320], 4), "INVALID_ARGUMENT",
         "prompt_token_ids: token id 320 at index 1 is outside the vocabulary [0, 320)"),
        (pb.GenerateRequest(model="gpt-9", text="hi"), "NOT_FOUND",
         "model 'gpt-9' does not exist; this server serves 'tiny'"),
    ],
)
def test_bad_input_gets_the_exact_code_and_the_server_keeps_serving(stub, reference, req, code, details):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert (e.value.code().name, e.value.details()) == (code, details)
    ok = [t for r in stub.Generate(request([256, 9, 9], 3), timeout=30) for t in r.token_ids]
    assert ok == reference([256, 9, 9], 3).token_ids


def test_at_the_context_limit_is_served(stub):
    last = list(stub.Generate(request([5] * 500, 12), timeout=60))[-1]
    assert (last.finish_reason, last.usage.completion_tokens) == (pb.FINISH_REASON_LENGTH, 12)


def test_client_cancel_mid_stream_frees_both_pools(stub):
    call = stub.Generate(request([256] + [4] * 30, max_tokens=470), timeout=120)
    got = [next(call) for _ in range(3)]
    assert all(len(r.token_ids) >= 1 for r in got)
    call.cancel()
    loads = wait_pools_whole()
    assert loads["decode"]["free_blocks"] == 64 and loads["prefill"]["free_blocks"] == 64


def test_deadline_is_honoured_and_frees_both_pools(stub):
    try:
        out = list(stub.Generate(request([256] + [6] * 30, max_tokens=470), timeout=0.15))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:  # 470 tokens inside 0.15 s: nothing to expire on a machine this fast (0.5 s was, since the
        # front door's legs went by gRPC: 470 tokens in 0.30 s here)
        assert sum(len(r.token_ids) for r in out) == 470
        pytest.skip("the whole stream finished before the deadline")
    wait_pools_whole()


# ---- OpenAI-compatible HTTP ----------------------------------------------------------------


def test_openai_client_completions_and_chat(server, tiny_model, reference):
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{http_base(server)}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]

    prompt = [256, 72, 101, 108, 108, 111]
    expected = reference(prompt, 10)
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].text == expected.text and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (6, 10)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) >= 2

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat_ids = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected_chat = reference(list(chat_ids), 8)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected_chat.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat_ids)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join((s.choices[0].delta.content or "") for s in stream if s.choices) == expected_chat.text
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[-1].usage.completion_tokens == 8
    wait_pools_whole()


def post(server, path, body):
    req = urllib.request.Request(f"{http_base(server)}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "top_k": -3}, 400, "top_k"),
        ({"prompt": [1, 99999]}, 400, "prompt_token_ids"),
        ({"prompt": "hi", "n": 9}, 400, "n"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "nope"}, 404, None),
    ],
)
def test_http_bad_input_status_codes(server, body, status, param):
    code, payload = post(server, "/v1/completions", body)
    assert code == status
    assert payload["error"]["param"] == param
    assert payload["error"]["message"]
    ok, result = post(server, "/v1/completions", {"prompt": [256, 1], "max_tokens": 2, "ignore_eos": True})
    assert ok == 200 and result["usage"]["completion_tokens"] == 2
