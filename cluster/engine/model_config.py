"""The parts of a Hugging Face `config.json` that the engine needs, parsed once.

Handles both the legacy keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
transformers-5 ones (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}  # model_type -> qkv bias
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: str
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported "
                f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"config.json dtype={dtype!r} is not one of {DTYPES}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=SUPPORTED_ARCHITECTURES[model_type] or cfg.get("attention_bias", False),
            dtype=dtype,
            rope=_parse_rope(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def fingerprint(self) -> str:
        """Stable id of the architecture (not the weights): part of every block-hash salt."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _parse_rope(cfg: dict) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported (default, llama3)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=params["factor"],
        low_freq_factor=params.get("low_freq_factor", 1.0),
        high_freq_factor=params.get("high_freq_factor", 4.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings", 8192),
    )
