"""response_format through the real app in disaggregated mode (every prompt prefilled remotely:
local_prefill_threshold 0), SmolLM2-135M-Instruct, with the official `openai` client and gRPC:
json_schema (strict) and json_object, streamed and not; each output equals the in-process
engine's and validates against its schema (jsonschema); a bad schema is 400 / INVALID_ARGUMENT
naming response_format; the pools end whole."""

import json

import grpc
import jsonschema
import openai
import pytest

from cluster.engine.chat_template import render_chat
from cluster.engine.grammar import ResponseFormat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow.tool_parser import HermesToolParser
from tests.engine.test_structured_output import ASK, COLOR, PERSON
from tests.helpers import grpc_stub, http_base, pool_loads, wait_pools_whole

MODEL = "smol"
N = 48


@pytest.fixture(scope="module")
def server(serve_apps, smollm2):
    with serve_apps.run(smollm2, served_model_name=MODEL, routing={"local_prefill_threshold": 0},
                        tool_call_parser="hermes") as cfg:
        yield cfg


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{http_base(server)}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine.from_model(smollm2, num_blocks=64)


def reference(engine, text: str, fmt: ResponseFormat) -> str:
    ids = engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": text}]),
                                  add_special_tokens=False)
    [out] = engine.generate([ids], SamplingParams(max_tokens=N, temperature=0, response_format=fmt))
    return engine.tokenizer.decode(out.token_ids)


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_over_the_openai_client(server, client, engine, stream):
    pulls = pool_loads()["decode"]["transfer"]["pulls_ok"]
    for name, schema in (("person", PERSON), ("color", COLOR)):
        messages = [{"role": "user", "content": ASK[name]}]
        kw = dict(model=MODEL, messages=messages, max_tokens=N, temperature=0,
                  response_format=schema_format(name, schema))
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            reply = client.chat.completions.create(**kw)
            text, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        assert text == reference(engine, ASK[name], engine.validator.response_format("json_schema", schema, True))
        assert finish == ["stop"]
        jsonschema.validate(json.loads(text), schema)
    assert pool_loads()["decode"]["transfer"]["pulls_ok"] == pulls + 2  # both prefilled on the prefill pool
    wait_pools_whole()


def test_json_object_over_completions_and_grpc_json_schema(server, client, engine):
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "Describe a cat as a JSON object."}])
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    ids = engine.validator.tokenize(prompt)
    [ref] = engine.generate([ids], SamplingParams(max_tokens=N, temperature=0,
                                                  response_format=ResponseFormat("json_object")))
    assert got.choices[0].text == engine.tokenizer.decode(ref.token_ids)
    assert got.choices[0].text.startswith("{")
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].text), dict)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=True,
                                            extra_body={"response_format": {"type": "json_object"}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=N, temperature=0, response_format=pb.ResponseFormat(
        type="json_schema", json_schema=json.dumps(COLOR), strict=True)))
    request.chat.messages.add(role="user", content=ASK["color"])
    with grpc_stub(server) as stub:
        replies = list(stub.Generate(request, timeout=120))
    text = "".join(r.text for r in replies)
    assert text == reference(engine, ASK["color"], engine.validator.response_format("json_schema", COLOR, True))
    assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), COLOR)
    wait_pools_whole()


def test_a_bad_schema_is_refused_naming_response_format(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=schema_format("bad", {"type": "strin"}))
    assert e.value.body["param"] == "response_format"
    assert e.value.body["message"] == "response_format: the JSON schema does not compile: Invalid type: strin"
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4, response_format=pb.ResponseFormat(
        type="json_schema", json_schema='{"items": ' * 20 + "{}" + "}" * 20)))
    with grpc_stub(server) as stub:
        with pytest.raises(grpc.RpcError) as g:
            list(stub.Generate(request, timeout=60))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in g.value.details() and "at most 16" in g.value.details()


TOOLS = [{"type": "function", "function": {"name": "set_color", "description": "Set a color and a digit.",
                                           "parameters": COLOR, "strict": True}},
         {"type": "function", "function": {"name": "add_person", "parameters": PERSON, "strict": True}}]


def tool_reference(engine, text: str, schema: dict) -> str:
    ids = engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": text}], tools=TOOLS),
                                  add_special_tokens=False)
    fmt = engine.validator.response_format("json_schema", schema, True)
    [out] = engine.generate([ids], SamplingParams(max_tokens=N, temperature=0, response_format=fmt))
    return engine.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_is_its_arguments_by_grammar(server, client, engine, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK["color"]}], max_tokens=N, temperature=0,
              tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_color"}})
    if stream:
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    else:
        reply = client.chat.completions.create(**kw)
        calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        assert (reply.choices[0].message.content, finish) == (None, "stop")
    [call] = calls
    assert (call.type, call.function.name) == ("function", "set_color") and call.id.startswith("call_")
    assert call.function.arguments == tool_reference(engine, ASK["color"], COLOR)
    jsonschema.validate(json.loads(call.function.arguments), COLOR)
    wait_pools_whole()


def test_required_tool_calls_name_known_tools_with_valid_arguments(server, client, engine):
    messages = [{"role": "user", "content": ASK["person"]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0,
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
    [call] = choice.message.tool_calls  # parallel_tool_calls false: one call
    schema = {"set_color": COLOR, "add_person": PERSON}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the history as a client sends it back: the call and its result render, and the chat goes on
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "done"}])
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.usage.completion_tokens >= 1
    wait_pools_whole()


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# SmolLM2 copies this call (its template does not show tools; it was not taught to call them unasked)
ECHO_CALL = 'Repeat exactly: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def free_reference(engine, text: str) -> tuple[str, str]:
    ids = engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": text}], tools=WEATHER),
                                  add_special_tokens=False)
    [out] = engine.generate([ids], SamplingParams(max_tokens=N, temperature=0))
    return engine.tokenizer.decode(out.token_ids), out.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_the_models_calls_and_passes_text_through(server, client, engine, stream):
    """tool_choice "auto" (the default with tools) with the hermes parser: SmolLM2's reply that
    holds a call becomes message.tool_calls (the text before it, content); a reply without one
    is its text. Both equal the in-process engine's output, parsed."""
    for ask, expected in ((ECHO_CALL, ("Repeat exactly:", [("get_weather", '{"city":"Paris"}')], "tool_calls")),
                          ("Say hello.", (None, [], "stop"))):
        text, finish = free_reference(engine, ask)
        parsed = HermesToolParser().parse(text, {"get_weather"}, complete=finish == "stop")
        assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == (expected[0] or text, expected[1])
        kw = dict(model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=N, temperature=0, tools=WEATHER)
        if stream:
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            assert chunks[0].choices[0].delta.role == "assistant"
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [expected[2]]
            assert [tc.index for tc in calls] == list(range(len(expected[1])))
        else:
            reply = client.chat.completions.create(**kw)
            content, calls = reply.choices[0].message.content, reply.choices[0].message.tool_calls or []
            assert reply.choices[0].finish_reason == expected[2]
        assert content == parsed.content
        assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [
            ("function", name, args) for name, args in expected[1]]
        assert all(c.id.startswith("call_") for c in calls)
    wait_pools_whole()


def grpc_chat(server, ask: str, **chat) -> list:
    with grpc_stub(server) as stub:
        return list(stub.Generate(pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=ask)], **chat),
            sampling=pb.SamplingParams(max_tokens=N, temperature=0)), timeout=60))


def test_tools_over_grpc_equal_the_http_path(server, engine):
    """Chat.tools over real gRPC: "auto" (the hermes parser) turns SmolLM2's call into
    GenerateResponse.tool_calls after the text before it, finish TOOL_CALLS; a named function's
    call is its grammar-forced arguments, sent whole on the last response, finish STOP."""
    weather = pb.Tool(name="get_weather", parameters='{"type": "object"}')
    responses = grpc_chat(server, ECHO_CALL, tools=[weather])
    assert "".join(r.text for r in responses) == "Repeat exactly:"
    assert [(c.name, c.arguments) for r in responses for c in r.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert [r.finish_reason for r in responses if r.finish_reason] == [pb.FINISH_REASON_TOOL_CALLS]

    color = pb.Tool(name="set_color", description="Set a color and a digit.", parameters=json.dumps(COLOR), strict=True)
    person = pb.Tool(name="add_person", parameters=json.dumps(PERSON), strict=True)
    responses = grpc_chat(server, ASK["color"], tools=[color, person], tool_choice="function", function_name="set_color")
    assert "".join(r.text for r in responses) == ""
    assert [(c.name, c.arguments) for r in responses for c in r.tool_calls] == [
        ("set_color", tool_reference(engine, ASK["color"], COLOR))]
    assert [r.finish_reason for r in responses if r.finish_reason] == [pb.FINISH_REASON_STOP]
    wait_pools_whole()


def test_a_bad_tool_over_grpc_is_invalid_argument_naming_it(server):
    with pytest.raises(grpc.RpcError) as e:
        grpc_chat(server, "hi", tools=[pb.Tool(name="f", parameters="{")])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "tools.0.parameters: is not JSON text, or nests too deep"
