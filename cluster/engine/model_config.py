"""The parts of a Hugging Face `config.json` (and `generation_config.json`) that the engine needs,
parsed once.

Handles both the legacy keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
transformers-5 ones (`rope_parameters`, `dtype`). From `generation_config.json`: every EOS id
(it often lists more than config.json, e.g. Llama 3's <|eot_id|>) and the model's recommended
sampling, which the app may use where a request gives none.

The model_type picks a family (model/families/): it parses its own fields (q/k norm, the MoE
counts) and refuses what it cannot serve, naming the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.engine.model.families import FAMILIES, family_of
from cluster.engine.model.families.base import (Family, GemmaFields, GroupedRouting, MLAConfig, MoEConfig,
                                                 WeightQuant, check_common,
                                                parse_quantization, sliding_window)

SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))  # the served model_types
# Family fields left out of the fingerprint at these values, so a Llama's is what it was before they existed.
_FINGERPRINT_DEFAULTS = {"qk_norm": False, "moe": None, "sliding_window": None, "weight_quant": None,
                         "hidden_act": "silu", "sliding_layers": (), "gemma": None, "local_rope": None,
                         "moe_routing": None, "mla": None}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class YarnConfig:
    """YaRN's own parameters (transformers' _compute_yarn_parameters names; model/rope.py)."""

    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    truncate: bool = True


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" (positions divided by factor) | "llama3" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    yarn: YarnConfig | None = None  # rope_type yarn's; None otherwise (and then left out of the fingerprint)


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling generation_config.json recommends; None where it says nothing. As vLLM, the
    values are taken whether or not it also says do_sample."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_hf_dict(cls, gen: dict) -> "GenerationDefaults":
        return cls(temperature=gen.get("temperature"), top_p=gen.get("top_p"), top_k=gen.get("top_k"))


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
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
    moe: MoEConfig | None = None  # the sparse MLP and the layers that have it; None: every MLP dense
    sliding_window: int | None = None  # some layer attends this many positions back; refused at load if it bites
    weight_quant: WeightQuant | None = None  # block-scaled fp8 weights, dequantized at load; None: float weights
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    sliding_layers: tuple[int, ...] = ()  # layers attending within sliding_window, served windowed (Gemma 3)
    gemma: GemmaFields | None = None  # Gemma's layer (norms, scales, softcapping): families/gemma3.py
    local_rope: RopeConfig | None = None  # the sliding layers' RoPE where it differs from `rope` (Gemma 3)
    moe_routing: GroupedRouting | None = None  # DeepSeek-V3's grouped sigmoid router + shared experts; None: softmax
    mla: MLAConfig | None = None  # latent attention (its cache holds the latent); head_dim is then its rope part's
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @classmethod
    def from_hf_dict(cls, cfg: dict, generation: dict | None = None) -> "ModelConfig":
        """`cfg`: config.json; `generation`: generation_config.json, if the checkpoint has one."""
        model_type = cfg.get("model_type", "llama")
        family = family_of(model_type)
        cfg = dict(family.defaults) | cfg
        check_common(cfg, family.own_activation)
        weight_quant = parse_quantization(cfg)
        fields = family.parse(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"config.json dtype={dtype!r} is not one of {DTYPES}")
        generation = generation or {}
        # generation_config's EOS ids first (transformers stops on those), then config.json's.
        eos_ids = tuple(dict.fromkeys(_ids(generation.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=fields.mla.qk_rope_head_dim if fields.mla else cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=fields.qkv_bias,
            dtype=dtype,
            qk_norm=fields.qk_norm,
            moe=fields.moe,
            sliding_window=sliding_window(cfg),
            weight_quant=weight_quant,
            rope=_parse_rope({"rope_parameters": fields.rope_global} if fields.rope_global else cfg),
            hidden_act=fields.hidden_act,
            sliding_layers=fields.sliding_layers,
            gemma=fields.gemma,
            local_rope=_parse_rope({"rope_parameters": fields.rope_local}) if fields.rope_local else None,
            moe_routing=fields.moe_routing,
            mla=fields.mla,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            generation_defaults=GenerationDefaults.from_hf_dict(generation),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        gen_path = Path(model_dir) / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_hf_dict(json.loads(path.read_text()), generation)

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    def fingerprint(self) -> str:
        """Stable id of the architecture (not the weights): part of every block-hash salt.
        Sampling defaults do not change what a KV block holds, so they are left out."""
        parts = asdict(self)
        del parts["generation_defaults"]
        for name, default in _FINGERPRINT_DEFAULTS.items():
            if parts[name] == default:
                del parts[name]
        if parts["rope"]["yarn"] is None:
            del parts["rope"]["yarn"]
        if (parts.get("moe_routing") or {}).get("scoring") == "sigmoid":
            del parts["moe_routing"]["scoring"]  # DeepSeek-V3's, as before the field existed
        blob = json.dumps(parts, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _parse_rope(cfg: dict) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported (default, linear, llama3, yarn)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type=rope_type, factor=params["factor"])
    if rope_type == "yarn":
        return _parse_yarn(cfg, params, theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=params["factor"],
        low_freq_factor=params.get("low_freq_factor", 1.0),
        high_freq_factor=params.get("high_freq_factor", 4.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings", 8192),
    )


def _parse_yarn(cfg: dict, params: dict, theta: float) -> RopeConfig:
    """As transformers' _compute_yarn_parameters reads them: factor None is max_position_embeddings
    over the original length (DeepSeek-V3's convention); beta_fast/slow 0 or None take 32/1."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"config.json rope_parameters.original_max_position_embeddings={original!r}: yarn needs "
                         "the pretrained context length, a positive integer")
    factor = params.get("factor") or cfg.get("max_position_embeddings", 2048) / original
    yarn = YarnConfig(beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                      mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                      attention_factor=params.get("attention_factor"), truncate=params.get("truncate", True))
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      yarn=yarn)
