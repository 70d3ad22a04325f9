"""The gRPC edge's prompt forms: text, token ids, chat messages (which the flow renders with the
model's template into the same ids /v1/chat/completions computes), and refusals naming the field."""

import json

import pytest

from cluster.config import AppConfig
from cluster.engine.chat_template import render_chat
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from cluster.engine.grammar import ResponseFormat
from cluster.engine.outputs import FinishReason, TokenLogprob
from router.ingress.api.grpc_api import (ToolOutput, delta_to_proto, prompt_from_proto, sampling_from_proto,
                                         tools_from_proto)
from router.ingress.flow.request_flow import RequestFlow
from router.ingress.flow.tools import tool_use
from router.ingress.gateway.front_door import Choice
from router.ingress.request import Delta, SamplingSpec


def params(flow, sp: "pb.SamplingParams"):
    """What the gRPC edge and the version's flow make of a SamplingParams message."""
    return flow.sampling(sampling_from_proto(sp, flow.config.engine.limits)).params


@pytest.fixture(scope="module")
def flow(smollm2):
    return RequestFlow(AppConfig(model=smollm2), None, None)


def test_each_prompt_form(flow):
    assert prompt_from_proto(pb.GenerateRequest(text="Hi"), 8) == ("Hi", None, None)
    assert prompt_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), 8) == (None, (5, 6), None)
    req = pb.GenerateRequest()
    req.chat.messages.add(role="system", content="Be brief.")
    req.chat.messages.add(role="user", content="What is the capital of France?")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    assert prompt_from_proto(req, 8) == (None, None, tuple(messages))
    text = render_chat(flow.tokenizer, messages)
    assert text.endswith("<|im_start|>assistant\n")
    assert flow.chat_ids(messages) == flow.tokenizer.encode(text, add_special_tokens=False)


def _chat(n: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    for _ in range(n):
        req.chat.messages.add(role="user", content="hi")
    return req


@pytest.mark.parametrize("req, field, message", [
    (pb.GenerateRequest(), "prompt", "set text, token_ids or chat"),
    (pb.GenerateRequest(text="Hi", priority=3), "priority", "is set by the tenant's configuration; leave it 0"),
    (_chat(3), "messages", "has 3 messages; at most 2 are accepted"),
])
def test_refusals_name_the_field(req, field, message):
    with pytest.raises(InvalidRequestError) as e:
        prompt_from_proto(req, 2)
    assert (e.value.field, e.value.message) == (field, message)


def _history() -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.chat.messages.add(role="user", content="Weather in Paris?")
    call = req.chat.messages.add(role="assistant", content="")
    call.tool_calls.add(id="call_1", name="weather", arguments='{"city":"Paris"}')
    req.chat.messages.add(role="tool", content="18 C", tool_call_id="call_1")
    return req


def test_a_call_and_its_result_in_the_history_reach_the_template_as_over_http():
    from router.ingress.api.openai_api import _message
    from router.ingress.api.openai_schema import ChatMessage

    http = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    expected = [_message(ChatMessage.model_validate(m), i) for i, m in enumerate(http)]
    assert prompt_from_proto(_history(), 8) == (None, None, tuple(expected))


@pytest.mark.parametrize("edit, field, message", [
    (lambda r: r.chat.messages[2].ClearField("tool_call_id"), "messages.2.tool_call_id",
     "a tool message needs the id of the call it answers"),
    (lambda r: r.chat.messages[0].tool_calls.add(id="c", name="f", arguments="{}"), "messages.0.tool_calls",
     "only an assistant message has tool_calls"),
    (lambda r: setattr(r.chat.messages[1].tool_calls[0], "id", "x" * 65), "messages.1.tool_calls.0.id",
     "String should have at most 64 characters"),
    (lambda r: setattr(r.chat.messages[0], "tool_call_id", "call_1"), "messages.0.tool_call_id",
     "only a tool message has a tool_call_id"),
])
def test_history_refusals_name_the_field_as_over_http(edit, field, message):
    req = _history()
    edit(req)
    with pytest.raises(InvalidRequestError) as e:
        prompt_from_proto(req, 8)
    assert (e.value.field, e.value.message) == (field, message)


def test_an_empty_chat_is_refused(flow):
    with pytest.raises(InvalidRequestError) as e:
        flow.chat_ids([])
    assert (e.value.field, e.value.message) == ("messages", "must hold at least one message")


# ---- sampling fields: penalties, logit_bias, min_p, logprobs --------------------------------

@pytest.fixture(scope="module")
def tiny_flow(tiny_model):
    return RequestFlow(AppConfig(model=tiny_model, default_max_tokens=16), None, None)


def test_the_sampling_fields_reach_sampling_params(tiny_flow):
    sp = pb.SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5,
                           min_p=0.125, logprobs=3, logit_bias={7: -100.0, 3: 2.5})
    got = params(tiny_flow, sp)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty, got.min_p, got.logprobs,
            got.logit_bias) == (0.5, -0.25, 1.5, 0.125, 3, ((3, 2.5), (7, -100.0)))
    unset = params(tiny_flow, pb.SamplingParams())
    assert unset.plain and unset.logprobs is None and unset.repetition_penalty == 1.0


@pytest.mark.parametrize("sp, field, message", [
    (pb.SamplingParams(presence_penalty=3), "presence_penalty", "must be in [-2.0, 2.0], got 3.0"),
    (pb.SamplingParams(repetition_penalty=0), "repetition_penalty", "must be in (0.0, 2.0], got 0.0"),
    (pb.SamplingParams(min_p=2), "min_p", "must be in [0.0, 1.0], got 2.0"),
    (pb.SamplingParams(logit_bias={5: 1000}), "logit_bias", "must be in [-100.0, 100.0], got 1000.0"),
    (pb.SamplingParams(logit_bias={i: 1.0 for i in range(10_000)}), "logit_bias",
     "has 10000 entries; at most 300 are accepted"),
])
def test_bad_sampling_fields_name_the_field_and_the_limit(tiny_flow, sp, field, message):
    with pytest.raises(InvalidRequestError) as e:
        params(tiny_flow, sp)
    assert (e.value.field, e.value.message) == (field, message)


def test_a_response_format_reaches_sampling_params(tiny_flow):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = params(tiny_flow, pb.SamplingParams(response_format=pb.ResponseFormat(
        type="json_schema", json_schema=json.dumps(schema, indent=2), strict=True)))
    assert got.response_format == ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":"),
                                                                           sort_keys=True), True)
    obj = params(tiny_flow, pb.SamplingParams(response_format=pb.ResponseFormat(type="json_object")))
    assert obj.response_format == ResponseFormat("json_object") and not obj.plain
    text = params(tiny_flow, pb.SamplingParams(response_format=pb.ResponseFormat(type="text")))
    assert text.response_format is None and text.plain


def _schema(text: str) -> pb.SamplingParams:
    return pb.SamplingParams(response_format=pb.ResponseFormat(type="json_schema", json_schema=text))


@pytest.mark.parametrize("sp, message", [
    (_schema('{"type": "strin"}'), "the JSON schema does not compile: Invalid type: strin"),
    (_schema('{"type": '), "json_schema is not JSON text, or nests too deep"),
    (_schema("[" * 20000 + "]" * 20000), "the JSON schema has 40000 bytes; at most 32768 are accepted"),
    (_schema("[" * 16000 + "]" * 16000), "json_schema is not JSON text, or nests too deep"),
    (_schema('{"items": ' * 20 + "{}" + "}" * 20), "the JSON schema nests 21 deep; at most 16 is accepted"),
    (pb.SamplingParams(response_format=pb.ResponseFormat(type="yaml")),
     "type must be text, json_object or json_schema, got 'yaml'"),
    (pb.SamplingParams(ignore_eos=True, response_format=pb.ResponseFormat(type="json_object")),
     "cannot be combined with ignore_eos or min_tokens"),
])
def test_a_bad_response_format_is_refused_naming_it(tiny_flow, sp, message):
    with pytest.raises(InvalidRequestError) as e:
        tiny_flow.validator.make_request("r", None, [1, 2], params(tiny_flow, sp))
    assert (e.value.field, e.value.message) == ("response_format", message)


@pytest.mark.parametrize("sp, field, message", [
    (pb.SamplingParams(logprobs=21), "logprobs", "asks for 21 top logprobs; at most 20 are accepted"),
    (pb.SamplingParams(logit_bias={320: 1.0}), "logit_bias", "token id 320 is outside the vocabulary [0, 320)"),
])
def test_the_validator_refuses_what_only_the_model_bounds(tiny_flow, sp, field, message):
    with pytest.raises(InvalidRequestError) as e:
        tiny_flow.validator.make_request("r", None, [1, 2], params(tiny_flow, sp))
    assert (e.value.field, e.value.message) == (field, message)


def test_logprobs_travel_in_the_response():
    d = Delta("r", "ab", [97, 98], logprobs=[TokenLogprob(97, -1.25, ((97, -1.25), (5, -2.5))),
                                             TokenLogprob(98, -0.5, ((98, -0.5), (6, -3.0)))])
    resp = pb.GenerateResponse.FromString(delta_to_proto(d).SerializeToString())
    assert [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in resp.logprobs] == [
        (97, -1.25, [(97, -1.25), (5, -2.5)]), (98, -0.5, [(98, -0.5), (6, -3.0)])]
    assert list(delta_to_proto(Delta("r", "a", [97])).logprobs) == []


def test_n_choices_interleave_with_their_index_and_a_failure_stops_the_others():
    import asyncio

    from router.ingress.api.choices import interleave
    from router.ingress.status import Code, ServingError

    closed = []

    async def stream(i: int, texts: list[str], fail: bool = False):
        try:
            for t in texts:
                yield Delta(f"r{i}", t, [])
            if fail:
                raise ServingError(Code.ABORTED, "replica lost")
            await asyncio.Event().wait()  # runs until stopped
        finally:
            closed.append(i)

    async def run():
        streams = [stream(0, ["a", "b"]), stream(1, ["c", "d"], fail=True)]
        choices = [Choice(s, await anext(s), None) for s in streams]
        got = []
        try:
            async for i, d in interleave(choices):
                got.append((i, d.text))
        except ServingError as e:
            got.append(e.message)
        return got

    got = asyncio.run(run())
    assert got[:2] == [(0, "a"), (1, "c")] and sorted(got[2:4]) == [(0, "b"), (1, "d")] and got[4:] == ["replica lost"]
    assert sorted(closed) == [0, 1]


@pytest.mark.parametrize("how", ["whole", "fails", "left", "left at the first", "cancelled"])
def test_one_choice_is_read_in_the_callers_task_and_closed_at_its_source(how):
    """n = 1: the stream runs in the task that reads `interleave` (no pump task between them),
    its deltas in order; a failure raises to the reader; a reader that leaves (at any delta, the
    first included) or is cancelled has the stream closed at its source by the time it is out."""
    import asyncio

    from router.ingress.api.choices import interleave
    from router.ingress.status import Code, ServingError

    tasks, closed = [], []

    async def stream():
        try:
            for t in ["a", "b", "c"]:
                tasks.append(asyncio.current_task())
                yield Delta("r0", t, [])
            if how == "fails":
                raise ServingError(Code.ABORTED, "replica lost")
            if how == "cancelled":
                await asyncio.Event().wait()  # runs until the reader's task is cancelled
        finally:
            closed.append(0)

    async def read(got: list):
        s = stream()
        deltas = interleave([Choice(s, await anext(s), None)])  # started, as the front door starts a choice
        try:
            async for i, d in deltas:
                got.append((i, d.text))
                if (how, d.text) in (("left", "b"), ("left at the first", "a")):
                    break
        except ServingError as e:
            got.append(e.message)
        finally:
            await deltas.aclose()
        return asyncio.current_task()

    async def run():
        got = []
        reader = asyncio.ensure_future(read(got))
        if how == "cancelled":
            while len(got) < 3:
                await asyncio.sleep(0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            return got, None, list(closed)  # read before asyncio.run's own clean-up closes anything
        return got, await reader, list(closed)

    got, reader, closed_then = asyncio.run(run())
    assert got == {"whole": [(0, "a"), (0, "b"), (0, "c")], "fails": [(0, "a"), (0, "b"), (0, "c"), "replica lost"],
                   "left": [(0, "a"), (0, "b")], "left at the first": [(0, "a")],
                   "cancelled": [(0, "a"), (0, "b"), (0, "c")]}[how]
    assert len(set(tasks)) == 1 and len(tasks) == {"left": 2, "left at the first": 1}.get(how, 3)
    if reader is not None:
        assert tasks[0] is reader
    assert closed_then == [0]


# ---- tools: Chat.tools, tool_choice, parallel_tool_calls; calls in GenerateResponse.tool_calls ----

def _tools_chat(**kw) -> pb.Chat:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], **kw)
    return chat


F = pb.Tool(name="f", parameters='{"type": "object"}')


@pytest.mark.parametrize("chat, field, message", [
    (_tools_chat(tools=[F] * 129), "tools", "has 129 tools; at most 128 are accepted"),
    (_tools_chat(tools=[pb.Tool(name="no spaces")]), "tools.0.name", "String should match pattern '^[A-Za-z0-9_-]{1,64}$'"),
    (_tools_chat(tools=[pb.Tool(name="f", parameters="{")]), "tools.0.parameters", "is not JSON text, or nests too deep"),
    (_tools_chat(tools=[pb.Tool(name="f", parameters=" " * 32769)]), "tools.0.parameters",
     "has 32769 bytes; at most 32768 are accepted"),
    (_tools_chat(tools=[F], tool_choice="maybe"), "tool_choice", "Input should be 'none', 'auto' or 'required'"),
    (_tools_chat(tools=[F], function_name="f"), "function_name", 'goes with tool_choice "function" only'),
])
def test_bad_tool_fields_name_the_field(chat, field, message):
    with pytest.raises(InvalidRequestError) as e:
        tools_from_proto(chat, pb.SamplingParams(), 32768)
    assert (e.value.field, e.value.message) == (field, message)


@pytest.mark.parametrize("chat, parser, field, message", [
    (_tools_chat(tools=[F]), "none", "tool_choice", "needs a tool-call parser"),
    (_tools_chat(tool_choice="required"), "none", "tool_choice", "needs tools"),
    (_tools_chat(tools=[F], tool_choice="function", function_name="g"), "none", "tool_choice",
     "names function 'g', which is not in tools"),
    (_tools_chat(tools=[F, F], tool_choice="required"), "none", "tools", "two tools have the same function name"),
])
def test_tool_choices_are_checked_as_over_http(chat, parser, field, message):
    with pytest.raises(InvalidRequestError) as e:
        tool_use(tools_from_proto(chat, pb.SamplingParams(), 32768), None, parser)
    assert e.value.field == field and message in e.value.message


def test_a_forced_call_becomes_the_requests_grammar(tiny_flow):
    tools = tools_from_proto(_tools_chat(tools=[F], tool_choice="function", function_name="f"),
                             pb.SamplingParams(), 32768)
    use = tool_use(tools, None)
    assert (use.forced, use.name) == ("named", "f")
    sampling = tiny_flow.sampling(SamplingSpec(), tools)
    assert sampling.use == use
    assert sampling.params.response_format == tiny_flow.validator.response_format("json_schema", {"type": "object"},
                                                                                  False)
    with pytest.raises(InvalidRequestError) as e:
        tiny_flow.sampling(SamplingSpec(ignore_eos=True), tools)
    assert (e.value.field, e.value.message) == ("tool_choice", "a forced tool call cannot be combined with ignore_eos")
    assert tools_from_proto(_tools_chat(), pb.SamplingParams(), 32768) is None


def _shape(use, deltas):
    out = ToolOutput(use)
    return [out.shape(delta_to_proto(d), d.finish_reason) for d in deltas]


def test_auto_calls_are_text_until_an_opener_then_one_tool_calls_response():
    use = tool_use(tools_from_proto(_tools_chat(tools=[F]), pb.SamplingParams(), 32768), None, "hermes")
    got = _shape(use, [Delta("r", "Sure.\n<tool", []), Delta("r", '_call>{"name": "f", "arguments": {"a": 1}}', []),
                       Delta("r", "</tool_call>", [], finish_reason=FinishReason.STOP)])
    assert [r.text for r in got] == ["Sure.", "", ""]
    assert [(c.name, c.arguments) for c in got[-1].tool_calls] == [("f", '{"a":1}')]
    assert got[-1].tool_calls[0].id.startswith("call_") and got[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    plain = _shape(use, [Delta("r", "Hi <tool", []), Delta("r", "box>", [], finish_reason=FinishReason.STOP)])
    assert [(r.text, len(r.tool_calls), r.finish_reason) for r in plain] == [
        ("Hi", 0, pb.FINISH_REASON_UNSPECIFIED), (" <toolbox>", 0, pb.FINISH_REASON_STOP)]


def test_a_forced_call_is_held_and_sent_whole():
    use = tool_use(tools_from_proto(_tools_chat(tools=[F], tool_choice="function", function_name="f"),
                                    pb.SamplingParams(), 32768), None)
    got = _shape(use, [Delta("r", '{"a"', []), Delta("r", ": 1}", [], finish_reason=FinishReason.STOP)])
    assert [r.text for r in got] == ["", ""]
    assert [(c.name, c.arguments) for c in got[-1].tool_calls] == [("f", '{"a": 1}')]
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP  # a named function's call ends STOP, as OpenAI's
    cut = _shape(use, [Delta("r", '{"a"', [], finish_reason=FinishReason.LENGTH)])
    assert [(r.text, len(r.tool_calls), r.finish_reason) for r in cut] == [('{"a"', 0, pb.FINISH_REASON_LENGTH)]
