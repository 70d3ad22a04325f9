"""A tenant's hostile input never hurts another tenant's stream (issue 14's "Done when"): while
tenant b's long greedy stream runs on a real disaggregated app, tenant a sends each hostile input
of the issue, over gRPC and HTTP. Each gets its exact code; b's stream ends with exactly the
tokens it produces alone; both pools come back to their totals.

Each refusal's latency, measured here by the client, is printed (`pytest -s`): speed goals live
in the note and docs/benchmarks.md, not in assertions."""

import itertools
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, wait_pools_whole

NEIGHBOUR = [256] + [(7 * i) % 250 for i in range(40)]
NEIGHBOUR_TOKENS = 400
TRIES = 3
HOSTILE_PROMPT = [256, 5, 6, 7]
AUTH_A = [("authorization", "Bearer key-a")]


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, served_model_name="tiny", engine={"num_blocks": 96},
                        routing={"local_prefill_threshold": 0},
                        tenants={"a": {"api_keys": ["key-a"]}, "b": {"api_keys": ["key-b"]}}) as cfg:
        yield cfg


def greedy(tiny_model, prompt, max_tokens):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].token_ids


def grpc_request(ids=HOSTILE_PROMPT, text=None, request_id="", **sampling):
    prompt = {"text": text} if text is not None else {"token_ids": pb.TokenIds(ids=ids)}
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **sampling}
    return pb.GenerateRequest(**prompt, request_id=request_id, sampling=pb.SamplingParams(**sampling))


GRPC_CASES = [  # (name, request, expected code, the start of its details)
    ("subnormal temperature (float32)", grpc_request(temperature=1e-40), "OK", None),
    ("100k stop strings", grpc_request(stop=["x"] * 100_000), "INVALID_ARGUMENT", "stop: has 100000 stop strings; at most 16 are accepted"),
    ("200k stop token ids", grpc_request(stop_token_ids=list(range(200_000))), "INVALID_ARGUMENT",
     "stop_token_ids: has 200000 token ids; at most 64 are accepted"),
    ("1M-character text prompt", grpc_request(text="a" * 1_000_000), "INVALID_ARGUMENT", "prompt: "),
    ("500k prompt token ids", grpc_request(ids=[5] * 500_000), "INVALID_ARGUMENT", "prompt: has 500000 tokens"),
    ("10k-character request_id", grpc_request(request_id="r" * 10_000), "INVALID_ARGUMENT",
     "request_id: has 10000 characters; at most 128 are accepted"),
    ("request_id with a newline", grpc_request(request_id="a\nb"), "INVALID_ARGUMENT",
     "request_id: must be printable ASCII without whitespace"),
    ("token id outside the vocabulary", grpc_request(ids=[5, 2**31]), "INVALID_ARGUMENT", "prompt_token_ids: "),
    ("max_tokens 4e9", grpc_request(max_tokens=4_000_000_000), "INVALID_ARGUMENT", "max_tokens: "),
    ("NaN top_p", grpc_request(top_p=float("nan")), "INVALID_ARGUMENT", "top_p: "),
    # the front door's own check, once the message is read (the transport reads up to 4x the limit)
    ("6 MB message", grpc_request(text="a" * 6_000_000), "INVALID_ARGUMENT",
     "request: message of 6000016 bytes exceeds grpc_max_receive_bytes 4194304"),
]

HTTP_CASES = [  # (name, [path,] body, headers, expected status, expected error param)
    ("subnormal temperature", json.dumps({"prompt": HOSTILE_PROMPT, "max_tokens": 4, "temperature": 1e-45, "ignore_eos": True}),
     {}, 200, None),
    ("lone surrogate in the prompt", '{"prompt": "hi \\ud800", "max_tokens": 4}', {}, 400, "prompt"),
    ("non-ASCII bearer key", json.dumps({"prompt": "hi"}), {"authorization": "Bearer kéy"}, 401, None),
    ("content part text not a string", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}), {}, 400, "messages.0.content.0.text"),
    ("max_tokens: true", json.dumps({"prompt": "hi", "max_tokens": True}), {}, 400, "max_tokens"),
    ("100k stop strings", json.dumps({"prompt": "hi", "stop": ["x"] * 100_000}), {}, 400, "stop"),
    ("response_format schema that does not compile", json.dumps({"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}), {}, 400, "response_format"),
    ("5 MB body", json.dumps({"prompt": "a" * 5_000_000}), {}, 413, "body"),
    ("unparsable JSON", '{"prompt": "hi",', {}, 400, "body"),
]


def post(server, body: str, headers: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    hdrs = {"content-type": "application/json", "authorization": "Bearer key-a", **headers}
    req = urllib.request.Request(f"{http_base(server)}{path}",
                                 data=body.encode("utf-8", "surrogatepass"),
                                 headers={k: v.encode("utf-8").decode("latin-1") for k, v in hdrs.items()})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_hostile_inputs_beside_a_stream_get_their_codes_and_the_stream_is_untouched(server, tiny_model):
    alone = greedy(tiny_model, NEIGHBOUR, NEIGHBOUR_TOKENS)
    hostile_greedy = greedy(tiny_model, HOSTILE_PROMPT, 4)
    with grpc_stub(server, options=[("grpc.max_send_message_length", 16 * 2**20)]) as stub:
        neighbour = stub.Generate(grpc_request(NEIGHBOUR, max_tokens=NEIGHBOUR_TOKENS),
                                  metadata=[("authorization", "Bearer key-b")], timeout=120)
        first = next(neighbour)  # b's stream is running before the first hostile input
        rest: list = []
        reader = threading.Thread(target=lambda: rest.extend(neighbour), daemon=True)
        reader.start()

        # tenant a's first request warms its path (the proxy's and the replica's first error path)
        list(stub.Generate(grpc_request(), metadata=AUTH_A, timeout=30))
        timings, wrong = [], []
        for (name, req, code, details), _ in itertools.product(GRPC_CASES, range(TRIES)):
            start = time.perf_counter()
            try:
                replies = list(stub.Generate(req, metadata=AUTH_A, timeout=30))
                got, got_details = "OK", None
            except grpc.RpcError as e:
                got, got_details = e.code().name, e.details()
            timings.append((f"gRPC {name}", got, time.perf_counter() - start))
            if got != code or (details is not None and not got_details.startswith(details)):
                wrong.append((name, got, got_details))
            elif code == "OK":
                assert [t for r in replies for t in r.token_ids] == hostile_greedy, name
        for (name, *path, body, headers, status, param), _ in itertools.product(HTTP_CASES, range(TRIES)):
            start = time.perf_counter()
            got, payload = post(server, body, headers, *path)
            timings.append((f"HTTP {name}", got, time.perf_counter() - start))
            if status == 200 and got == 200:
                assert payload["choices"][0]["finish_reason"] == "length", name
            elif (got, payload.get("error", {}).get("param")) != (status, param) or not payload["error"]["message"]:
                wrong.append((name, got, payload))
        assert wrong == []
        tokens_when_done = len(first.token_ids) + sum(len(r.token_ids) for r in list(rest))
        reader.join(120)
        assert not reader.is_alive()
    assert list(first.token_ids) + [t for r in rest for t in r.token_ids] == alone
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH

    print(f"\nhostile inputs beside a {NEIGHBOUR_TOKENS}-token stream "
          f"(it had {tokens_when_done} tokens when the last refusal came back):")
    by_case: dict[tuple, list[float]] = {}
    for name, got, seconds in timings:
        by_case.setdefault((name, got), []).append(seconds * 1000)
    print(f"  {'median':>7} {'max':>7} (ms, {TRIES} tries)")
    for (name, got), ms in by_case.items():
        print(f"  {statistics.median(ms):7.1f} {max(ms):7.1f}  {got!s:<18} {name}")
    refusals = [s for _, g, s in timings if g not in ("OK", 200)]
    print(f"  refusals: {len(refusals)}, max {max(refusals) * 1000:.1f} ms, "
          f"{sum(s < 0.1 for s in refusals)} under 100 ms")
    wait_pools_whole()
