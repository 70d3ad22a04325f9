"""Two versions of one architecture (same config.json, other weights) never share a KV block or a
transfer: the block-hash salt and the layout's fingerprint include the weights' digest."""

from __future__ import annotations

import shutil

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.identity import model_identity, weights_digest
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.layout import engine_layout

ARCH = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512)


def test_identity_is_architecture_plus_weights(model_factory, tmp_path):
    v1, v2 = model_factory("v1", seed=1, **ARCH), model_factory("v2", seed=2, **ARCH)
    assert ModelConfig.from_dir(v1).fingerprint() == ModelConfig.from_dir(v2).fingerprint()
    assert model_identity(v1) != model_identity(v2)
    assert model_identity(v1).split(".")[0] == ModelConfig.from_dir(v1).fingerprint()
    copy = tmp_path / "copy"
    shutil.copytree(v1, copy)
    assert model_identity(copy) == model_identity(v1)  # the bytes, not the path
    assert len(weights_digest(v1)) == 16


def test_versions_share_no_cached_block_and_no_transfer(model_factory):
    v1, v2 = model_factory("c1", seed=1, **ARCH), model_factory("c2", seed=2, **ARCH)
    e1, e2 = LLMEngine.from_model(v1, num_blocks=16), LLMEngine.from_model(v2, num_blocks=16)
    prompt = list(range(1, 41))  # 2 full blocks of 16
    for e in (e1, e2):
        e.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    h1, h2 = e1.cached_block_hashes(), e2.cached_block_hashes()
    assert len(h1) == len(h2) == 2 and not set(h1) & set(h2)
    with pytest.raises(IncompatiblePeerError, match="refusing KV from v2: model_fingerprint"):
        engine_layout(e1).check_compatible(engine_layout(e2), "v2")
    engine_layout(e1).check_compatible(engine_layout(LLMEngine.from_model(v1, num_blocks=16)), "v1 again")
