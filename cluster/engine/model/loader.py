"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not).

The family's renames (model/families/) say where each checkpoint tensor goes: a whole parameter,
one part of a fused one (q/k/v into qkv_proj, gate/up into gate_up_proj), or one expert's slice
of a stacked [E, ...] one. Every parameter, part and expert slice must come from the checkpoint,
and every checkpoint tensor must have a place.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cluster.engine.model import fp8_weights
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """Where one checkpoint tensor goes."""

    target: str  # the model parameter
    part: int | None = None  # its rows' place in a fused parameter; None: all the rows
    expert: int | None = None  # its slice of a stacked [E, ...] parameter; None: not an expert's

    @property
    def key(self) -> str:
        return f"{self.target}#{self.part}" if self.expert is None else f"{self.target}#{self.expert}.{self.part}"


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def check_context(cfg: ModelConfig, max_positions: int) -> None:
    """A family that names its sliding layers (Gemma 3) has them attend within the window
    (attention/window.py); for the others attention is full: exact for a sliding-window model only
    while no context is longer than its window (transformers: position i sees j when i - j < window)."""
    if cfg.sliding_window is not None and not cfg.sliding_layers and max_positions > cfg.sliding_window:
        raise ValueError(f"config.json sliding_window={cfg.sliding_window} is smaller than the context served "
                         f"(max_model_len {max_positions}): sliding-window attention is not implemented; "
                         f"serve this model with max_model_len <= {cfg.sliding_window}")


def load_model(model_dir: str | Path, cfg: ModelConfig, max_positions: int, dtype, device) -> DecoderForCausalLM:
    model_dir = Path(model_dir)
    check_context(cfg, max_positions)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions, dtype, torch.device("meta"))
    model.materialize(device)
    model.build_rotary(max_positions, dtype, device)  # not in checkpoints
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    scales = fp8_weights.read_scales(safetensors_files(model_dir)) if cfg.weight_quant else {}
    for f, name, piece, dest in checkpoint_entries(model_dir, cfg, params):
        tensor = fp8_weights.dequantize(name, f.get_tensor(name), scales, cfg.weight_quant, dtype)
        dest = piece_of(dest, piece, cfg)
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded |= keys_of(piece, params[piece.target])
    check_loaded(model, cfg, loaded, model_dir)
    fp8_weights.check_scales_used(scales)
    model.eval()
    return model


def piece_of(dest: torch.Tensor, piece: Piece, cfg: ModelConfig) -> torch.Tensor:
    """The rows of parameter data `dest` that `piece` fills."""
    if piece.expert is not None:
        dest = dest[piece.expert]
    if piece.part is None:
        return dest
    sizes = part_sizes(piece.target, dest.shape[0], cfg)
    return dest.narrow(0, sum(sizes[: piece.part]), sizes[piece.part])


def part_sizes(target: str, rows: int, cfg: ModelConfig) -> list[int]:
    """The row counts of a fused parameter's parts: q, k, v heads; or gate and up halves."""
    if "qkv_proj" in target:
        q = rows - 2 * cfg.num_kv_heads * cfg.head_dim
        return [q, (rows - q) // 2, (rows - q) // 2]
    return [rows // 2, rows // 2]


def checkpoint_entries(model_dir: Path, cfg: ModelConfig, params: dict[str, torch.nn.Parameter]
                       ) -> Iterator[tuple[Any, str, Piece, torch.Tensor]]:
    """Every checkpoint tensor that has a place in the model: (its open safetensors file, its name,
    where it goes, that parameter's data). A tensor with no place is refused."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = checkpoint_target(name, cfg)
                if piece is None:
                    continue
                if piece.target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                yield f, name, piece, params[piece.target].data


def checkpoint_target(name: str, cfg: ModelConfig) -> Piece | None:
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    if "rotary_emb" in name or (cfg.weight_quant and name.endswith(fp8_weights.SCALE_SUFFIX)):
        return None  # not parameters (the fp8 scales are read first: fp8_weights.read_scales)
    if cfg.family.skips_extra_layers and _layer_of(name) >= cfg.num_layers:
        return None  # a module stored past the last layer (DeepSeek-V3's multi-token prediction), not the model's
    for rename in cfg.family.renames:
        m = re.search(rename.pattern, name)
        if m:
            expert = m.groupdict().get("expert")
            target = name[: m.start()] + rename.target + name[m.end():]
            return Piece(target, rename.part, None if expert is None else int(expert))
    return Piece(name)


def _layer_of(name: str) -> int:
    m = re.match(r"layers\.(\d+)\.", name)
    return -1 if m is None else int(m.group(1))


def parts(name: str, param: torch.Tensor) -> set[str]:
    """The keys (Piece.key) a parameter is loaded as: one per fused part and per expert."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
        return {Piece(name, p, e).key for e in range(param.shape[0]) for p in halves}
    if "qkv_proj" in name:
        return {Piece(name, i).key for i in range(3)}
    if "gate_up_proj" in name:
        return {Piece(name, i).key for i in range(2)}
    return {Piece(name).key}


def keys_of(piece: Piece, param: torch.Tensor) -> set[str]:
    """The keys a checkpoint tensor fills: one, or every part of the parameter it fills whole
    (Phi-3's qkv_proj, transformers 5's stacked experts)."""
    if piece.part is None and piece.expert is None:
        return parts(piece.target, param)
    return {piece.key}


def check_loaded(model: DecoderForCausalLM, cfg: ModelConfig, loaded: set[str], model_dir: Path) -> None:
    """Every parameter (each part of a fused one: `target#part`, each expert's: `target#expert.part`)
    came from the checkpoint."""
    missing = expected_keys(model, cfg) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def expected_keys(model: DecoderForCausalLM, cfg: ModelConfig) -> set[str]:
    return {key for name, p in model.named_parameters() if not name.startswith("rotary") for key in parts(name, p)}
