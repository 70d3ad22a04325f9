"""The gRPC edge's prompt forms: text, token ids, chat messages (which the flow renders with the
model's template into the same ids /v1/chat/completions computes), and refusals naming the field."""

import pytest

from cluster.config import AppConfig
from cluster.engine.chat_template import render_chat
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow import RequestFlow
from router.ingress.grpc_api import prompt_from_proto


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
