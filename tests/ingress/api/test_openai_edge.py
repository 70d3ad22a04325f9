"""The OpenAI edge without Ray: limits before parsing (413, message count, headers), unsupported
fields refused naming them, sampling fields accepted or refused with the limit, the session key's
sources, and FastAPI's own refusals in OpenAI's error shape."""

import asyncio
import json

import pytest

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError


# ---- HTTP: limits before parsing, fields, codes ------------------------------------------------

def asgi(app, path, body: bytes | list[bytes], headers=(), method="POST", raw=False):
    """One request through the ASGI app; `body` as a list is sent in chunks (no Content-Length).
    (status, the JSON body), or with `raw` (status, the body's bytes)."""
    chunks = body if isinstance(body, list) else [body]
    inbox = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    hdrs = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers)]
    if not isinstance(body, list):
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": hdrs,
             "server": ("test", 80), "client": ("test", 1)}
    asyncio.run(app(scope, receive, send))
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], content if raw else json.loads(content)


@pytest.fixture()
def app(tiny_model):
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    cfg = AppConfig.model_validate({"model": tiny_model, "ingress_limits": {"max_body_bytes": 2048,
                                                                           "max_chat_messages": 3}})
    openai_api.bind(front_door(cfg))
    yield openai_api.app
    openai_api.bind(None)


def test_a_large_body_is_413_before_parsing(app):
    big = json.dumps({"prompt": "x" * 3000}).encode()
    for body in (big, [big[:1000], big[1000:2000], big[2000:]], b"{" * 5000):
        status, err = asgi(app, "/v1/completions", body)
        assert status == 413 and err["error"]["param"] == "body" and "2048 bytes" in err["error"]["message"]


def test_too_many_chat_messages_name_messages(app):
    body = {"messages": [{"role": "user", "content": "hi"}] * 4}
    status, err = asgi(app, "/v1/chat/completions", json.dumps(body).encode())
    assert (status, err["error"]["param"]) == (400, "messages") and "at most 3" in err["error"]["message"]


@pytest.mark.parametrize("content, param", [
    ([{"type": "text", "text": 5}], "messages.0.content.0.text"),
    ([{"type": "text", "text": ["a"]}], "messages.0.content.0.text"),
    ([{"type": "image_url", "image_url": {"url": "x"}}], "messages.0.content.0.type"),
])
def test_a_bad_content_part_is_400_naming_it(app, content, param):
    status, err = asgi(app, "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": content}]}).encode())
    assert (status, err["error"]["param"]) == (400, param)


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "n", 9),  # 1..max_choices (8)
    ("/v1/chat/completions", "n", 0),
    ("/v1/chat/completions", "echo", True),  # completions only (OpenAI's)
    ("/v1/completions", "suffix", "x"),
])
def test_unsupported_openai_fields_are_refused_naming_them(app, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, err = asgi(app, path, json.dumps({**body, field: value}).encode())
    assert (status, err["error"]["param"]) == (400, field), err
    assert err["error"]["message"].startswith(f"{field}: ")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [TOOL]}, "tool_choice", "'auto' (the default with tools) needs a tool-call parser"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "names function 'g', which is not in tools"),
    ({"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools", "two tools have the same function name"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": [TOOL], "tool_choice": "required", "ignore_eos": True}, "tool_choice", "cannot be combined with ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "none"},
     "tools.0.function.name", "String should match pattern"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "needs the id of the call"),
    ({"messages": [USER | {"tool_call_id": "c"}]}, "messages.0.tool_call_id", "only a tool message"),
    ({"messages": [USER | {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "only an assistant message"),
])
def test_tool_fields_are_checked_together_and_refused_naming_the_field(app, extra, param, message):
    status, err = asgi(app, "/v1/chat/completions", json.dumps({"messages": [USER], **extra}).encode())
    assert (status, err["error"]["param"]) == (400, param), err
    assert err["error"]["message"].startswith(f"{param}: ") and message in err["error"]["message"], err


@pytest.mark.parametrize("extra", [{"tools": [TOOL], "tool_choice": "none"}, {"tools": [TOOL], "tool_choice": "required"},
                                   {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}])
def test_usable_tool_choices_pass_validation(app, extra):
    status, err = asgi(app, "/v1/chat/completions", json.dumps({"messages": [USER], "max_tokens": 2, **extra}).encode())
    assert status == 503, err  # past validation and admission: this test has no decode pool


@pytest.mark.parametrize("extra", [{"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False},
                                   {"tools": [TOOL], "response_format": {"type": "json_object"}}])
def test_tool_choice_auto_passes_validation_with_a_tool_call_parser(tiny_model, extra):
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    cfg = AppConfig.model_validate({"model": tiny_model, "tool_call_parser": "hermes"})
    openai_api.bind(front_door(cfg))
    try:
        status, err = asgi(openai_api.app, "/v1/chat/completions",
                           json.dumps({"messages": [USER], "max_tokens": 2, **extra}).encode())
    finally:
        openai_api.bind(None)
    assert status == 503, err  # past validation and admission: this test has no decode pool


def test_neutral_values_and_harmless_fields_are_accepted(app):
    body = {"prompt": "hi", "max_tokens": 2, "n": 1, "best_of": 1, "echo": False, "logprobs": None,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1",
            "metadata": {"k": "v"}, "response_format": {"type": "text"}, "stream_options": {"include_usage": True}}
    status, err = asgi(app, "/v1/completions", json.dumps(body).encode())
    assert status == 503, err  # past validation and admission: this test has no decode pool


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"logit_bias": {"5": 10, "319": -100}, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                         "repetition_penalty": 1.2, "min_p": 0.1, "logprobs": 5}),
    ("/v1/chat/completions", {"logit_bias": {"0": 100}, "presence_penalty": 2, "logprobs": True, "top_logprobs": 20}),
    ("/v1/chat/completions", {"logprobs": False}),
    ("/v1/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
])
def test_the_sampling_fields_we_implement_are_accepted(app, path, fields):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, err = asgi(app, path, json.dumps({**body, **fields}).encode())
    assert status == 503, err  # past validation (engine validator included) and admission; no decode pool


@pytest.mark.parametrize("path, fields, param, message", [
    ("/v1/completions", {"logit_bias": {"5": 1000}}, "logit_bias", "must be in [-100.0, 100.0], got 1000"),
    ("/v1/completions", {"logit_bias": {"x5": 1}}, "logit_bias", "key 'x5' is not a token id (a non-negative integer)"),
    ("/v1/completions", {"logit_bias": {"-5": 1}}, "logit_bias", "key '-5' is not a token id (a non-negative integer)"),
    ("/v1/completions", {"logit_bias": {"5": "a"}}, "logit_bias", "must be a number, got 'a'"),
    ("/v1/completions", {"logit_bias": {"320": 1}}, "logit_bias", "token id 320 is outside the vocabulary [0, 320)"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty", "must be in [-2.0, 2.0], got 3.0"),
    ("/v1/chat/completions", {"frequency_penalty": -2.01}, "frequency_penalty", "must be in [-2.0, 2.0], got -2.01"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "must be in (0.0, 2.0], got 0.0"),
    ("/v1/completions", {"min_p": 1.5}, "min_p", "must be in [0.0, 1.0], got 1.5"),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "must be in [0, 5], got 6"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "must be in [0, 5], got -1"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20], got 21"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "strin"}}}}, "response_format", "the JSON schema does not compile: Invalid type: strin"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "pattern": "("}}}}, "response_format", "the JSON schema does not compile: regex parse error:\n"
     "    (\n    ^\nerror: unclosed group"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": json.loads(
        '{"type": "array", "items": ' * 16 + '{"type": "string"}' + '}' * 16)}}}, "response_format",
     "the JSON schema nests 17 deep; at most 16 is accepted"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format", "type json_schema needs json_schema: {name, schema}"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "ignore_eos": True},
     "response_format", "cannot be combined with ignore_eos or min_tokens"),
])
def test_bad_sampling_values_are_400_naming_the_field_and_the_limit(app, path, fields, param, message):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, err = asgi(app, path, json.dumps({**body, **fields}).encode())
    assert (status, err["error"]["param"], err["error"]["message"]) == (400, param, f"{param}: {message}"), err


def test_ten_thousand_logit_bias_entries_are_refused_by_their_count(tiny_model):
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    cfg = AppConfig.model_validate({"model": tiny_model})  # the default body cap (4 MiB) lets it in
    openai_api.bind(front_door(cfg))
    try:
        body = {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(10_000)}}
        status, err = asgi(openai_api.app, "/v1/completions", json.dumps(body).encode())
    finally:
        openai_api.bind(None)
    assert (status, err["error"]["param"]) == (400, "logit_bias")
    assert err["error"]["message"] == "logit_bias: has 10000 entries; at most 300 are accepted"


def test_a_long_timeout_header_is_400_naming_it(app):
    status, err = asgi(app, "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
                       headers=[("x-pdserve-timeout-s", "1" * 40)])
    assert (status, err["error"]["param"]) == (400, "x-pdserve-timeout-s")


@pytest.mark.parametrize("headers, extra, param, message", [
    ([("x-session-id", "s" * 129)], {}, "x-session-id", "x-session-id: longer than 128 characters"),
    ([("x-session-id", "conv 1")], {}, "x-session-id",
     "x-session-id: must be 1 to 128 characters: letters, digits and . _ : @ / + = -"),
    ([("x-session-id", "")], {}, "x-session-id",
     "x-session-id: must be 1 to 128 characters: letters, digits and . _ : @ / + = -"),
    ([], {"prompt_cache_key": "k" * 129}, "prompt_cache_key", "prompt_cache_key: longer than 128 characters"),
    ([], {"prompt_cache_key": "a\nb"}, "prompt_cache_key",
     "prompt_cache_key: must be 1 to 128 characters: letters, digits and . _ : @ / + = -"),
    ([], {"user": "u" * 257}, "user", None),
])
def test_a_bad_session_key_is_400_naming_it(app, headers, extra, param, message):
    status, err = asgi(app, "/v1/completions", json.dumps({"prompt": "hi", **extra}).encode(), headers=headers)
    assert (status, err["error"]["param"]) == (400, param), err
    if message is not None:
        assert err["error"]["message"] == message


@pytest.mark.parametrize("headers, extra", [
    ([("x-session-id", "conv-7f3a:turn/2+x=@." + "s" * 107)], {}),  # 128 characters, every allowed kind
    ([], {"prompt_cache_key": "tenant-a.sys-prompt-3"}),
    ([], {"user": "alice smith <a@example.com>"}),  # user keeps its own cap (256, any text)
    ([("x-session-id", "a")], {"prompt_cache_key": "b", "user": "c"}),
])
def test_a_good_session_key_passes_the_edge(app, headers, extra):
    status, err = asgi(app, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, **extra}).encode(),
                       headers=headers)
    assert status == 503, err  # past validation and admission: this test has no decode pool


def test_session_key_sources_in_order():
    from router.ingress.api.headers import session_key

    assert session_key("h", "p", "u", 8) == "s:h"
    assert session_key(None, "p", "u", 8) == "s:p"
    assert session_key(None, None, "u", 8) == "u:u"  # a user and a header of the same text differ
    assert session_key(None, None, None, 8) is None and session_key(None, None, "", 8) is None
    with pytest.raises(InvalidRequestError) as e:
        session_key("h" * 9, None, None, 8)  # the cap is checked before the characters are looked at
    assert (e.value.field, e.value.message) == ("x-session-id", "longer than 8 characters")


@pytest.mark.parametrize("path, body, method, status, param", [
    ("/v1/completions", b'{"prompt": "hi",', "POST", 400, "body"),       # not JSON
    ("/v1/completions", b'\xff\xfe{}', "POST", 400, "body"),             # not UTF-8
    ("/v1/no-such-thing", b"{}", "POST", 404, None),
    ("/v1/completions", b"", "GET", 405, None),
])
def test_fastapis_own_refusals_carry_the_openai_error_object(app, path, body, method, status, param):
    got, err = asgi(app, path, body, method=method)
    assert (got, set(err), set(err["error"]), err["error"]["param"]) == (
        status, {"error"}, {"message", "type", "param", "code"}, param), err
    assert err["error"]["message"]


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_no_api_schema_or_docs_page_is_served(app, path):
    status, err = asgi(app, path, b"", method="GET")
    assert (status, err["error"]["message"]) == (404, "Not Found")


# ---- /metrics: no key, no tenant names with keys configured (docs/architecture.md, threat model) ---

@pytest.fixture()
def keyed(tiny_model):
    """The app with tenant acme's key configured (auth on), acme holding one in-flight slot."""
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    door = front_door(AppConfig.model_validate({"model": tiny_model, "tenants": {"acme": {"api_keys": ["sk-acme"]}}}))
    openai_api.bind(door)
    ticket = door.admission.reserve("acme")
    yield openai_api.app
    ticket.done()
    openai_api.bind(None)


@pytest.mark.parametrize("headers", [(), [("authorization", "Bearer sk-wrong")], [("authorization", "Bearer sk-acme")]])
def test_metrics_answer_without_a_key_and_name_no_tenant_when_keys_are_configured(keyed, headers):
    """A Prometheus scraper has no API key (vLLM's /metrics asks for none), so /metrics is 200
    with or without one; a key-less caller must not learn the tenants, so with keys configured
    no series names one."""
    status, text = asgi(keyed, "/metrics", b"", headers, method="GET", raw=True)
    assert status == 200
    series = [line for line in text.decode().splitlines() if not line.startswith("#")]
    assert "pdserve_ingress_inflight 1.0" in series
    assert b"acme" not in text and b"tenant" not in text
    assert asgi(keyed, "/v1/models", b"", headers, method="GET")[0] == (200 if headers and "sk-acme" in headers[0][1]
                                                                       else 401)  # auth is on elsewhere


def test_metrics_count_in_flight_per_tenant_when_auth_is_off(tiny_model):
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    door = front_door(AppConfig.model_validate({"model": tiny_model}))
    openai_api.bind(door)
    ticket = door.admission.reserve("default")
    try:
        status, text = asgi(openai_api.app, "/metrics", b"", method="GET", raw=True)
    finally:
        ticket.done()
        openai_api.bind(None)
    assert status == 200 and 'pdserve_ingress_tenant_inflight{tenant="default"} 1.0' in text.decode().splitlines()


@pytest.fixture()
def canary(tiny_model):
    """Keys configured; model tiny at v1 (weight 1) with a canary at weight 0; acme may not pin,
    ops may, beta is held on the canary by a tenant override."""
    from router.ingress.api import openai_api
    from tests.helpers import front_door

    cfg = AppConfig.model_validate({
        "models": {"tiny": {"versions": {"v1": {"model": tiny_model, "weight": 1},
                                         "cand": {"model": tiny_model, "weight": 0}},
                            "tenant_overrides": {"beta": "cand"}}},
        "tenants": {"acme": {"api_keys": ["sk-acme"]}, "ops": {"api_keys": ["sk-ops"], "pin_versions": True},
                    "beta": {"api_keys": ["sk-beta"]}}})
    openai_api.bind(front_door(cfg))
    yield openai_api.app
    openai_api.bind(None)


UNKNOWN_KEY = {"error": {"message": "missing or unknown API key (authorization: Bearer <key>)",
                         "type": "authentication_error", "param": None, "code": "unauthenticated"}}


@pytest.mark.parametrize("key, versions", [
    (None, None), ("sk-wrong", None),  # as /v1/models: 401
    ("sk-acme", ["v1"]),  # the canary at weight 0 is not listed to a tenant that cannot get it
    ("sk-beta", ["v1", "cand"]),  # held on the canary by its tenant override
    ("sk-ops", ["v1", "cand"]),  # may pin: every version, as it may name each
])
def test_version_asks_for_the_key_models_asks_for_and_lists_what_it_lists(canary, key, versions):
    from router.ingress.api.probes import package_version

    headers = [("authorization", f"Bearer {key}")] if key else []
    version = asgi(canary, "/version", b"", headers, method="GET")
    listed = asgi(canary, "/v1/models", b"", headers, method="GET")
    if versions is None:
        assert version == listed == (401, UNKNOWN_KEY)
        return
    assert version == (200, {"version": package_version(), "model": "tiny", "mode": "disaggregated",
                             "models": {"tiny": versions}})
    assert (listed[0], [(m["id"], m["versions"]) for m in listed[1]["data"]]) == (200, [("tiny", versions)])
