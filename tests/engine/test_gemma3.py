"""Gemma 3's sliding layers: the window bites (transformers' tokens change without it), every
attention path keeps to it (decode kernels and prefill spans against a dense reference), and a
block wholly before every sliding layer's window is never read (poisoned with NaN, the tokens stay
transformers'). Tokens on 1-300-token prompts, chunked and from the prefix cache: test_families.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.attention import AttentionMetadata, PrefillSpan, resolve_backend
from cluster.engine.attention.paged_decode import paged_decode_torch, paged_decode_triton
from cluster.engine.attention.window import windowed
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model_config import ModelConfig
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts
from tests.engine.test_families import hf_config, write_checkpoint
from tests.reference import hf_greedy

WINDOW, BS = 24, 16


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3_text", seed=21)


def test_the_window_changes_transformers_tokens(gemma, tmp_path):
    """The tokens test_families compares would differ had the sliding layers attended fully: the
    same weights with a window past every context give transformers other tokens."""
    wide = tmp_path / "wide"
    shutil.copytree(gemma, wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(cfg | {"sliding_window": 512}))
    p = prompts(1, [300], seed=22)[0]
    assert hf_greedy(gemma, p, 12) != hf_greedy(str(wide), p, 12)


def dense_reference(q, keys, values, q_pos, window, scale):
    """q [n, H, D] at positions q_pos, keys/values [L, H_kv, D] at 0..L-1: causal within the window."""
    k_pos = torch.arange(keys.shape[0])
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    g = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1).transpose(0, 1), values.repeat_interleave(g, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def paged(n_blocks, lens, firsts=None, hkv=2, d=32, seed=23):
    """A pool whose blocks wholly before each row's window (before `firsts`, by default a decode's)
    hold NaN; a table per row over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_blocks, BS, hkv, d, generator=g)
    v = torch.randn(n_blocks, BS, hkv, d, generator=g)
    width = max(-(-n // BS) for n in lens)
    ids = torch.randperm(n_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    dense = [(k[ids[r]].reshape(-1, hkv, d)[:n].clone(), v[ids[r]].reshape(-1, hkv, d)[:n].clone())
             for r, n in enumerate(lens)]
    for r, n in enumerate(lens):
        first = max(0, n - WINDOW) // BS if firsts is None else firsts[r]  # the block of the first key it reaches
        k[ids[r, :first]] = float("nan")
        v[ids[r, :first]] = float("nan")
    return k, v, ids.int(), dense


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                            reason="the Triton kernel runs on CUDA (tests/gpu) or under TRITON_INTERPRET=1")


@pytest.mark.parametrize("backend", ["torch", "cpu_paged", "static", pytest.param("triton", marks=TRITON)])
def test_decode_attends_within_the_window_and_never_reads_before_it(backend):
    lens = [1, 23, 24, 25, 40, 47, 48, 49, 130]  # around the window and block edges
    k, v, tables, dense = paged(96, lens)
    q = torch.randn(len(lens), 4, 32)
    meta = windowed(AttentionMetadata(
        slot_blocks=torch.zeros(len(lens), dtype=torch.long), slot_offsets=torch.zeros(len(lens), dtype=torch.long),
        num_decode=len(lens), prefills=(), cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, max_q_len=1, max_seq_len=max(lens),
        block_size=BS, decode_seq_lens=tuple(lens)), WINDOW)
    if backend in ("static", "triton"):
        kernel = paged_decode_torch if backend == "static" else paged_decode_triton
        out = kernel(q, k, v, meta.block_tables, meta.seq_lens, 0.2, meta.window)
    else:
        try:
            attn = resolve_backend(backend, torch.device("cpu"), BS)
        except ValueError as e:
            pytest.skip(str(e))
        out = attn.attend(q, None, None, k, v, meta, 0.2)
    for r, n in enumerate(lens):
        ref = dense_reference(q[r:r + 1], *dense[r], torch.tensor([n - 1]), WINDOW, 0.2)
        torch.testing.assert_close(out[r:r + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start, q_len", [(0, 60), (0, 20), (40, 30), (100, 1), (7, 64)])
def test_a_chunk_attends_within_the_window_and_never_reads_before_it(start, q_len):
    """A prefill chunk (cold, or after `start` tokens from the cache) through the torch path every
    backend uses for multi-token chunks: its span starts at the first block its first row's window reaches."""
    ctx = start + q_len
    first = max(0, start - WINDOW + 1) // BS  # blocks before it hold NaN
    k, v, tables, dense = paged(40, [ctx], [first])
    q = torch.randn(q_len, 4, 32)
    fresh_k, fresh_v = dense[0][0][start:], dense[0][1][start:]
    mask = None if start == 0 else torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    meta = windowed(AttentionMetadata(
        slot_blocks=torch.zeros(q_len, dtype=torch.long), slot_offsets=torch.zeros(q_len, dtype=torch.long),
        num_decode=0, prefills=(PrefillSpan(0, q_len, ctx, tables[0, : -(-ctx // BS)].long(), mask),),
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32), seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=tables, max_q_len=q_len, max_seq_len=ctx, block_size=BS), WINDOW)
    out = resolve_backend("torch", torch.device("cpu"), BS).attend(q, fresh_k, fresh_v, k, v, meta, 0.2)
    ref = dense_reference(q, *dense[0], torch.arange(start, ctx), WINDOW, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    span = meta.prefills[0]
    assert (span.ctx_len, span.block_ids.numel()) == (ctx - first * BS, -(-ctx // BS) - first)


@pytest.mark.parametrize("engine_kw", [{}, {"model_ops": "torch", "attention_backend": "torch"},
                                       {"model_ops": "torch", "attention_backend": "torch", "static_decode": "eager"}],
                         ids=["auto", "torch", "static_eager"])
def test_cached_blocks_before_every_window_are_never_read_by_sliding_layers(gemma, engine_kw):
    """A 200-token prompt's blocks stay cached; the sliding layers' K/V of the blocks wholly before the
    follow-up's first window (0-9 of its 12 cached ones) are set to NaN. The follow-up (from the cache,
    then decoding) still gives transformers' tokens: no sliding layer read them, the global layer's K/V
    there is intact."""
    eng = LLMEngine.from_model(gemma, num_blocks=64, max_num_batched_tokens=64, block_size=BS, **engine_kw)
    base = prompts(1, [200], seed=24)[0]
    eng.generate([base], GREEDY)
    hashes = eng.kv.update_hashes(SimpleNamespace(all_token_ids=base, block_hashes=[], cache_salt=""))
    blocks = [eng.kv.pool.lookup(h).block_id for h in hashes]
    assert len(blocks) == 12
    sliding = list(ModelConfig.from_dir(gemma).sliding_layers)
    first = (192 - WINDOW + 1) // BS  # the follow-up computes from token 192; its window reaches block 10
    assert (sliding, first) == ([0, 2], 10)
    for b in blocks[:first]:
        for layer in sliding:
            eng.kv_cache[b, layer] = float("nan")
    follow = base + [5, 6, 7]
    out = eng.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == 192
    assert out.token_ids == hf_greedy(gemma, follow, 12)
    static = eng.runner.static
    assert (static is not None and static.steps > 0) == ("static_decode" in engine_kw)  # its decodes took that path
    assert_leak_free(eng)


def test_a_legacy_config_reads_as_transformers_reads_it():
    """Hub configs of transformers 4 (sliding_window_pattern, rope_theta, rope_local_base_freq,
    rope_scaling) give the same ModelConfig as the transformers-5 form transformers writes of them."""
    from transformers import Gemma3TextConfig

    legacy = {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
              "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
              "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    ours = ModelConfig.from_hf_dict(legacy)
    assert ours == ModelConfig.from_hf_dict(Gemma3TextConfig(**legacy).to_dict())
    assert (ours.sliding_layers, ours.rope.rope_type, ours.rope.factor, ours.rope.theta, ours.local_rope.theta,
            ours.tie_word_embeddings) == ((0, 1, 2, 3, 4, 6), "linear", 8.0, 1e6, 1e4, True)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "config.json attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "config.json use_bidirectional_attention=True is not supported"),
    ({"hidden_activation": "gelu"}, "config.json hidden_activation='gelu' is not supported"),
    ({"sliding_window": None}, "config.json sliding_window=None is not supported"),
    ({"layer_types": ["sliding_attention"]}, "config.json layer_types=['sliding_attention'] is not supported: "
                                             "it must name each of the 3 layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "config.json rope_type='dynamic' is not supported"),
])
def test_what_gemma3_cannot_serve_is_refused_by_name(change, message):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(hf_config("gemma3_text").to_dict() | change)
    assert str(e.value).startswith(message)


def test_the_multimodal_gemma3_is_refused_naming_the_text_model():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": hf_config("gemma3_text").to_dict()})
    assert str(e.value).startswith("config.json model_type='gemma3' is not supported: the multimodal Gemma 3 "
                                   "checkpoint")
    assert "gemma3_text checkpoint (Gemma3ForCausalLM) is" in str(e.value)
