"""The checkpoint's generation_config.json sampling (temperature, top_p, top_k) is what a request
that leaves them unset gets, at both edges, as in vLLM; a value the request sets wins, and
`generation_config: none` keeps pdserve's own defaults."""

import json
from pathlib import Path

import pytest

from cluster.config import AppConfig
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow import RequestFlow
from router.ingress.grpc_api import sampling_from_proto
from router.ingress.openai_schema import CompletionRequest, to_sampling_params


@pytest.fixture(scope="module")
def model(model_factory):
    d = Path(model_factory("gen-defaults"))
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    return str(d)


def flow(model, **cfg):
    return RequestFlow(AppConfig(model=model, **cfg), None, None)


def test_the_flow_reads_the_checkpoints_defaults_or_none(model, tiny_model):
    assert flow(model).sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert flow(model, generation_config="none").sampling_defaults == {}
    assert flow(tiny_model).sampling_defaults == {}  # its generation_config.json names only bos/eos


def test_both_edges_fill_only_the_unset_fields(model):
    f = flow(model)
    defaults, v = f.sampling_defaults, f.validator
    unset = sampling_from_proto(pb.SamplingParams(max_tokens=4), 16, v, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.9, 20, 4)
    chosen = sampling_from_proto(pb.SamplingParams(temperature=0.0, top_k=0), 16, v, defaults)
    assert (chosen.temperature, chosen.top_p, chosen.top_k, chosen.max_tokens) == (0.0, 0.9, 0, 16)

    unset = to_sampling_params(CompletionRequest(prompt="hi"), 16, v, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    chosen = to_sampling_params(CompletionRequest(prompt="hi", temperature=1.0, top_p=0.5), 16, v, defaults)
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (1.0, 0.5, 20)
    plain = to_sampling_params(CompletionRequest(prompt="hi"), 16, v, {})
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
