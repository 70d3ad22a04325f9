"""Bad input: a clear error naming the field and the limit, and the engine keeps serving."""

import math

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine.from_model(tiny_model, num_blocks=40, max_model_len=256)


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
        ({"max_tokens": -3}, "max_tokens", "must be >= 1, got -3"),
        ({"max_tokens": 2.5}, "max_tokens", "must be an integer, got 2.5"),
        ({"temperature": math.nan}, "temperature", "must be a finite number, got nan"),
        ({"temperature": -0.1}, "temperature", "must be in [0.0, 100.0], got -0.1"),
        ({"top_p": 0.0}, "top_p", "must be in (0.0, 1.0], got 0.0"),
        ({"top_p": 1.5}, "top_p", "must be in (0.0, 1.0], got 1.5"),
        ({"top_p": math.inf}, "top_p", "must be a finite number, got inf"),
        ({"top_k": -1}, "top_k", "must be >= 0, got -1"),
        ({"stop": ("",)}, "stop", "stop strings must be non-empty strings, got ''"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "must be <= max_tokens (2), got 5"),
    ],
)
def test_bad_sampling_params(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert (e.value.field, e.value.message) == (field, message)


@pytest.mark.parametrize(
    "prompt, ids, max_tokens, field, message",
    [
        ("", None, 4, "prompt", "must be a non-empty string"),
        (None, [], 4, "prompt_token_ids", "must not be empty"),
        (None, [1, 320, 2], 4, "prompt_token_ids", "token id 320 at index 1 is outside the vocabulary [0, 320)"),
        (None, [1, -1], 4, "prompt_token_ids", "token id -1 at index 1 is outside the vocabulary [0, 320)"),
        (None, [5] * 256, 1, "prompt", "has 256 tokens; the context length is 256, so at most 255 fit"),
        (None, [5] * 200, 57, "max_tokens",
         "prompt (200 tokens) + max_tokens (57) = 257 exceeds the context length 256"),
        (None, [5] * 10, 10**9, "max_tokens",
         "prompt (10 tokens) + max_tokens (1000000000) = 1000000010 exceeds the context length 256"),
        ("hi", [1], 4, "prompt", "give exactly one of prompt or prompt_token_ids"),
    ],
)
def test_bad_requests_name_field_and_limit(engine, prompt, ids, max_tokens, field, message):
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("r", prompt, ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert (e.value.field, e.value.message) == (field, message)


def test_at_the_context_limit_is_accepted_and_served(engine):
    out = engine.generate([[5] * 200], SamplingParams(max_tokens=56, temperature=0, ignore_eos=True))[0]
    assert out.num_output_tokens == 56 and out.finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_more_blocks_than_the_pool_is_rejected(tiny_model):
    small = LLMEngine.from_model(tiny_model, num_blocks=4)
    with pytest.raises(InvalidRequestError) as e:
        small.make_request("r", None, [1] * 60, SamplingParams(max_tokens=10))
    assert e.value.message == "prompt + max_tokens needs 5 KV blocks; the pool has 4"


def test_stop_token_outside_vocabulary(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("r", "hi", None, SamplingParams(stop_token_ids=(999,)))
    assert e.value.field == "stop_token_ids"


def test_engine_keeps_serving_after_bad_input(engine):
    for bad in ([], [10**6]):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", prompt_token_ids=bad)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.num_output_tokens == 4
    assert not engine.has_unfinished()


def test_the_ingress_validates_with_the_configured_limits(tiny_model):
    from cluster.config import AppConfig
    from router.ingress.flow.request_flow import RequestFlow

    flow = RequestFlow(AppConfig(model=tiny_model, engine={"limits": {"max_prompt_chars": 10}}), None, None)
    with pytest.raises(InvalidRequestError) as e:
        flow.validator.make_request("r", "x" * 11)
    assert (e.value.field, e.value.message) == ("prompt", "has 11 characters; at most 10 are accepted")


def _post(app, path: str, body: dict) -> tuple[int, dict]:
    """One HTTP request straight through the ASGI app (no server, no client library)."""
    import asyncio
    import json

    inbox = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent = []

    async def receive():
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("test", 80), "client": ("test", 1)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.mark.parametrize(
    "content, message",
    [
        ("hi \ud800", "messages: is not valid Unicode: a lone surrogate '\\ud800' at index"),
        ("x" * 200, "messages: has"),
    ],
)
def test_a_chat_prompt_meets_the_prompt_caps_before_tokenizing(tiny_model, content, message):
    from cluster.config import AppConfig
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    openai_api.bind(front_door(AppConfig(model=tiny_model, engine={"limits": {"max_prompt_chars": 150}})))
    try:
        status, body = _post(openai_api.app, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    finally:
        openai_api.bind(None)
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"].startswith(message)


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", True, "max_tokens"), ("temperature", False, "temperature"), ("top_k", True, "top_k"),
    ("seed", True, "seed"), ("stop_token_ids", [5, True], "stop_token_ids.1")])
def test_a_boolean_is_not_a_number_in_the_http_body(field, value, param):
    from router.ingress.api import openai_api

    status, body = _post(openai_api.app, "/v1/completions", {"prompt": "hi", field: value})
    assert (status, body["error"]["param"]) == (400, param)
    assert body["error"]["message"] == f"{param}: Value error, a boolean is not a number"
