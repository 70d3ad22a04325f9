"""The checkpoint's generation_config.json sampling (temperature, top_p, top_k) is what a request
that leaves them unset gets, at both edges, as in vLLM; a value the request sets wins, and
`generation_config: none` keeps pdserve's own defaults."""

import json
from pathlib import Path

import pytest

from cluster.config import AppConfig
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.api.grpc_api import sampling_from_proto
from router.ingress.api.openai_schema import CompletionRequest, sampling_spec
from router.ingress.flow.request_flow import RequestFlow


@pytest.fixture(scope="module")
def model(model_factory):
    d = Path(model_factory("gen-defaults"))
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    return str(d)


def flow(model, **cfg):
    return RequestFlow(AppConfig(model=model, default_max_tokens=16, **cfg), None, None)


def test_the_flow_reads_the_checkpoints_defaults_or_none(model, tiny_model):
    assert flow(model).sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert flow(model, generation_config="none").sampling_defaults == {}
    assert flow(tiny_model).sampling_defaults == {}  # its generation_config.json names only bos/eos


def test_both_edges_fill_only_the_unset_fields(model, tiny_model):
    f = flow(model)
    limits = f.config.engine.limits
    unset = f.sampling(sampling_from_proto(pb.SamplingParams(max_tokens=4), limits)).params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.9, 20, 4)
    chosen = f.sampling(sampling_from_proto(pb.SamplingParams(temperature=0.0, top_k=0), limits)).params
    assert (chosen.temperature, chosen.top_p, chosen.top_k, chosen.max_tokens) == (0.0, 0.9, 0, 16)

    unset = f.sampling(sampling_spec(CompletionRequest(prompt="hi"), limits)).params
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    chosen = f.sampling(sampling_spec(CompletionRequest(prompt="hi", temperature=1.0, top_p=0.5), limits)).params
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (1.0, 0.5, 20)
    plain = flow(tiny_model).sampling(sampling_spec(CompletionRequest(prompt="hi"), limits)).params
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
