"""The embedded default model served for real: SmolLM2-135M-Instruct answers a chat over HTTP (the
`openai` client) and gRPC (`Chat` messages) with exactly what the in-process engine answers, in
disaggregated mode, and the pools end with every block free."""

import pytest

from cluster.engine.chat_template import render_chat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, wait_pools_whole

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(serve_apps, smollm2):
    from cluster.app.builder import ensure_model

    with serve_apps.run(None) as cfg:  # no model: the builder serves the embedded default, as `make run` does
        cfg = ensure_model(cfg)
        assert (cfg.model, cfg.served_model_name) == (smollm2, "smollm2-135m-instruct")
        yield cfg


def test_the_default_model_answers_a_chat_over_http_and_grpc(server, smollm2):
    import openai

    engine = LLMEngine.from_model(smollm2, num_blocks=64)
    ids = engine.validator.tokenize(render_chat(engine.tokenizer, QUESTION), add_special_tokens=False)
    [ref] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0))
    assert ref.text == "The capital of France is Paris."  # the model itself, before any serving

    client = openai.OpenAI(base_url=f"{http_base(server)}/v1", api_key="unused")
    reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=30,
                                           temperature=0)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (ref.text, "stop")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(ref.token_ids))

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=30, temperature=0))
    request.chat.messages.add(role="user", content=QUESTION[0]["content"])
    with grpc_stub(server) as stub:
        replies = list(stub.Generate(request, timeout=120))
    assert [t for r in replies for t in r.token_ids] == ref.token_ids
    assert "".join(r.text for r in replies) == ref.text
    assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
    wait_pools_whole()
