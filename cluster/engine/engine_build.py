"""What an LLMEngine is built from: the weights and the KV pool (one process, or rank 0 of a
tensor-parallel group), the speculator, and the line logged when it is ready. Plain functions the
engine's constructor calls once; nothing here runs on a step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.attention.fp8_kv import kv_quant_for
from cluster.engine.config import EngineConfig, cache_dtype, kv_block_shape
from cluster.engine.model.loader import load_model
from cluster.engine.model.ops import resolve_ops
from cluster.engine.model_config import ModelConfig
from cluster.engine.outputs import EngineStats
from cluster.engine.spec.controller import Speculator
from cluster.engine.spec.draft import DraftProposer
from cluster.engine.spec.proposer import make_proposer
from cluster.engine.static_decode import static_mode

log = logging.getLogger("cluster.engine.llm_engine")  # the engine's own logger: its ready line stays where it was


@dataclass
class Weights:
    model: Any  # the model, or the tensor-parallel driver standing in for it (rank 0)
    ops: Any
    kv_cache: torch.Tensor  # [num_blocks, L, 2, block_size, H_kv, D]
    pool: torch.Tensor  # kv_cache plus, on the static decode path, its sink block
    tensor_parallel: Any  # TensorParallelDriver | None
    static: str | None  # static_mode's answer


def load_weights(config: EngineConfig, mc: ModelConfig, num_blocks: int, max_model_len: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device, tokenizer) -> Weights:
    if config.tensor_parallel_size > 1:  # rank 0 of a sharded model: its heads of every block
        from cluster.engine.distributed.driver import TensorParallelDriver  # noqa: PLC0415

        tp = TensorParallelDriver.start(config, mc, num_blocks, max_model_len, device)
        static = static_mode(config, device, mc.family.cuda_graphs)
        # no static path under tp (static_mode): StaticDecode.for_engine returns None
        return Weights(tp, tp.ops, tp.kv_cache, tp.kv_cache, tp, static)
    static = static_mode(config, device, mc.family.cuda_graphs)
    model = load_model(config.model, mc, max_model_len, dtype, device)
    ops = resolve_ops("torch" if static and config.model_ops == "auto" else config.model_ops, device, dtype)
    model.use_ops(ops)
    # The static decode path's padding rows write one block past the pool's end (its sink):
    # allocated here, never accounted, never registered for transfer.
    pool = torch.zeros(num_blocks + (1 if static else 0), *kv_block_shape(mc, config.block_size),
                       dtype=kv_dtype, device=device)
    kv_cache = pool[:num_blocks]
    model.kv_quant = kv_quant_for(model, kv_dtype, tokenizer, max_model_len, config.block_size, device)
    return Weights(model, ops, kv_cache, pool, None, static)


def make_speculator(config: EngineConfig, mc: ModelConfig, num_blocks: int, max_model_len: int, dtype: torch.dtype,
                    device: torch.device, backend, ops, stats: EngineStats) -> Speculator | None:
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method == "draft":  # a second model and KV pool, beside this one
        proposer = DraftProposer.load(
            spec.draft_model, mc, spec.draft_num_blocks or num_blocks, config.block_size, max_model_len,
            dtype, device, backend, ops)
    else:
        proposer = make_proposer(spec.method, spec.ngram_min, spec.ngram_max)
    return Speculator(spec, proposer, stats, max_model_len)


def log_ready(engine) -> None:
    config, kv, bb = engine.config, engine.kv, engine.block_bytes
    log.info(
        "engine ready: model=%s dtype=%s kv=%s device=%s attention=%s blocks=%d x %d tokens (%.1f MiB)%s",
        config.model, engine.model_config.dtype, cache_dtype(engine.model_config, config), engine.device,
        engine.runner.backend.name, kv.num_blocks, config.block_size, kv.num_blocks * bb / 2**20,
        "".join(f", {t.name} tier {t.num_blocks} blocks ({t.num_blocks * bb / 2**20:.1f} MiB)" for t in kv.tiers),
    )
