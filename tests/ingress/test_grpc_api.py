"""The gRPC edge's prompt forms: text, token ids, a chat rendered with the model's template (the
same ids /v1/chat/completions computes), and refusals that name the field."""

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
    assert prompt_from_proto(pb.GenerateRequest(text="Hi"), flow) == ("Hi", None)
    assert prompt_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), flow) == (None, [5, 6])
    req = pb.GenerateRequest()
    req.chat.messages.add(role="system", content="Be brief.")
    req.chat.messages.add(role="user", content="What is the capital of France?")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    text = render_chat(flow.tokenizer, messages)
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt_from_proto(req, flow) == (None, flow.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("req, field, message", [
    (pb.GenerateRequest(), "prompt", "set text, token_ids or chat"),
    (pb.GenerateRequest(text="Hi", priority=3), "priority", "is set by the tenant's configuration; leave it 0"),
    (pb.GenerateRequest(chat=pb.Chat()), "messages", "must hold at least one message"),
])
def test_refusals_name_the_field(flow, req, field, message):
    with pytest.raises(InvalidRequestError) as e:
        prompt_from_proto(req, flow)
    assert (e.value.field, e.value.message) == (field, message)
