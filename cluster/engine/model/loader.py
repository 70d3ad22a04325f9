"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cluster.engine.model.llama import LlamaForCausalLM
from cluster.engine.model.rope import RotaryEmbedding
from cluster.engine.model_config import ModelConfig

log = logging.getLogger(__name__)

_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(model_dir: str | Path, cfg: ModelConfig, max_positions: int, dtype, device) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, dtype, torch.device("meta"))
    model.to_empty(device=device)
    model.tie_weights()  # to_empty materialises tied parameters separately
    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)  # not in checkpoints
    params = dict(model.named_parameters())
    split = {
        "self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                               cfg.num_kv_heads * cfg.head_dim],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[str] = set()
    for f, name, target, shard, dest in checkpoint_entries(model_dir, cfg, params):
        tensor = f.get_tensor(name)
        if shard is not None:
            kind = "self_attn.qkv_proj" if "qkv" in target else "mlp.gate_up_proj"
            sizes = split[kind]
            start = sum(sizes[:shard])
            dest = dest.narrow(0, start, sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(f"{target}#{shard}")
    check_loaded(model, cfg, loaded, model_dir)
    model.eval()
    return model


def checkpoint_entries(model_dir: Path, cfg: ModelConfig, params: dict[str, torch.nn.Parameter]
                       ) -> Iterator[tuple[Any, str, str, int | None, torch.Tensor]]:
    """Every checkpoint tensor that has a place in the model: (its open safetensors file, its name,
    the model parameter it goes to, its part of a fused parameter or None, that parameter's data).
    A tensor with no place is refused."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                target, shard = checkpoint_target(name, cfg)
                if target is None:
                    continue
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                yield f, name, target, shard, params[target].data


def check_loaded(model: LlamaForCausalLM, cfg: ModelConfig, loaded: set[str], model_dir: Path) -> None:
    """Every parameter (each part of a fused one: `target#shard`) came from the checkpoint."""
    missing = expected_keys(model, cfg) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def checkpoint_target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    if "rotary_emb" in name:
        return None, None
    for src, (dst, shard) in _FUSED.items():
        if f".{src}." in name:
            return name.replace(src, dst), shard
    return name, None


def expected_keys(model: LlamaForCausalLM, cfg: ModelConfig) -> set[str]:
    keys = set()
    for name, _ in model.named_parameters():
        if name.startswith("rotary"):
            continue
        if "qkv_proj.weight" in name or "qkv_proj.bias" in name:
            keys |= {f"{name}#{i}" for i in range(3)}
        elif "gate_up_proj" in name:
            keys |= {f"{name}#{i}" for i in range(2)}
        else:
            keys.add(f"{name}#None")
    return keys
