"""The gRPC edge's prompt forms: text, token ids, chat messages (which the flow renders with the
model's template into the same ids /v1/chat/completions computes), and refusals naming the field."""

import json

import pytest

from cluster.config import AppConfig
from cluster.engine.chat_template import render_chat
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from cluster.engine.outputs import TokenLogprob
from router.ingress.flow import Delta, RequestFlow
from cluster.engine.grammar import ResponseFormat
from router.ingress.grpc_api import delta_to_proto, prompt_from_proto, sampling_from_proto


@pytest.fixture(scope="module")
def flow(smollm2):
    return RequestFlow(AppConfig(model=smollm2), None, None)


def test_each_prompt_form(flow):
    assert prompt_from_proto(pb.GenerateRequest(text="Hi"), 8) == ("Hi", None, None)
    assert prompt_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), 8) == (None, [5, 6], None)
    req = pb.GenerateRequest()
    req.chat.messages.add(role="system", content="Be brief.")
    req.chat.messages.add(role="user", content="What is the capital of France?")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    assert prompt_from_proto(req, 8) == (None, None, messages)
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


def test_an_empty_chat_is_refused(flow):
    with pytest.raises(InvalidRequestError) as e:
        flow.chat_ids([])
    assert (e.value.field, e.value.message) == ("messages", "must hold at least one message")


# ---- sampling fields: penalties, logit_bias, min_p, logprobs --------------------------------

@pytest.fixture(scope="module")
def tiny_flow(tiny_model):
    return RequestFlow(AppConfig(model=tiny_model), None, None)


def test_the_sampling_fields_reach_sampling_params(tiny_flow):
    sp = pb.SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5,
                           min_p=0.125, logprobs=3, logit_bias={7: -100.0, 3: 2.5})
    got = sampling_from_proto(sp, 16, tiny_flow.validator)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty, got.min_p, got.logprobs,
            got.logit_bias) == (0.5, -0.25, 1.5, 0.125, 3, ((3, 2.5), (7, -100.0)))
    unset = sampling_from_proto(pb.SamplingParams(), 16, tiny_flow.validator)
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
        sampling_from_proto(sp, 16, tiny_flow.validator)
    assert (e.value.field, e.value.message) == (field, message)


def test_a_response_format_reaches_sampling_params(tiny_flow):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = sampling_from_proto(pb.SamplingParams(response_format=pb.ResponseFormat(
        type="json_schema", json_schema=json.dumps(schema, indent=2), strict=True)), 16, tiny_flow.validator)
    assert got.response_format == ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":"),
                                                                           sort_keys=True), True)
    obj = sampling_from_proto(pb.SamplingParams(response_format=pb.ResponseFormat(type="json_object")), 16,
                              tiny_flow.validator)
    assert obj.response_format == ResponseFormat("json_object") and not obj.plain
    text = sampling_from_proto(pb.SamplingParams(response_format=pb.ResponseFormat(type="text")), 16,
                               tiny_flow.validator)
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
        tiny_flow.validator.make_request("r", None, [1, 2], sampling_from_proto(sp, 16, tiny_flow.validator))
    assert (e.value.field, e.value.message) == ("response_format", message)


@pytest.mark.parametrize("sp, field, message", [
    (pb.SamplingParams(logprobs=21), "logprobs", "asks for 21 top logprobs; at most 20 are accepted"),
    (pb.SamplingParams(logit_bias={320: 1.0}), "logit_bias", "token id 320 is outside the vocabulary [0, 320)"),
])
def test_the_validator_refuses_what_only_the_model_bounds(tiny_flow, sp, field, message):
    with pytest.raises(InvalidRequestError) as e:
        tiny_flow.validator.make_request("r", None, [1, 2], sampling_from_proto(sp, 16, tiny_flow.validator))
    assert (e.value.field, e.value.message) == (field, message)


def test_logprobs_travel_in_the_response():
    d = Delta("r", "ab", [97, 98], logprobs=[TokenLogprob(97, -1.25, ((97, -1.25), (5, -2.5))),
                                             TokenLogprob(98, -0.5, ((98, -0.5), (6, -3.0)))])
    resp = pb.GenerateResponse.FromString(delta_to_proto(d).SerializeToString())
    assert [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in resp.logprobs] == [
        (97, -1.25, [(97, -1.25), (5, -2.5)]), (98, -0.5, [(98, -0.5), (6, -3.0)])]
    assert list(delta_to_proto(Delta("r", "a", [97])).logprobs) == []
