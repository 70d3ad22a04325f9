"""What a model family declares. Torch-free: ModelConfig reads it, and the front door imports ModelConfig.

A family is one `Family` value: how its own config.json fields read (q/k norm, the MoE counts, which
layers are sparse) and which values it refuses, how its checkpoint's tensor names map onto the
model's parameters, and what the engine's special paths may assume of its layers. The model itself
is built from the shared blocks (model/layers.py, model/moe.py, model/decoder.py), steered by the
ModelConfig fields a family's `parse` returns; a family needing a new block adds it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def unsupported(field: str, value, why: str) -> ValueError:
    """The refusal of a config.json value: it names the field, the value and what is served instead."""
    return ValueError(f"config.json {field}={value!r} is not supported: {why}")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's (the dense layers keep ModelConfig.intermediate_size)
    renormalize: bool  # the top-k softmax weights divided by their sum (Mixtral always, Qwen3-MoE by norm_topk_prob)
    float32_weights: bool  # expert outputs scaled by the float32 routing weights (Mixtral), else by the model dtype's
    sparse_layers: tuple[int, ...]  # the layers whose MLP is this MoE; the others are dense

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise unsupported("num_experts_per_tok", self.top_k, f"it must be 1..{self.num_experts} (the experts)")


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): float32 sigmoid scores; the experts
    are chosen by score + a per-expert correction bias (`e_score_correction_bias`), only within the
    `topk_groups` of `num_groups` expert groups whose two best biased scores sum highest; a choice
    weighs its unbiased score (renormalised by MoEConfig.renormalize, + 1e-20), times `scaling`. The
    layer adds `shared_intermediate_size` always-on experts as one dense MLP.

    scoring "softmax" is DeepSeek-V2's router (transformers' DeepseekV2TopkRouter): float32 softmax
    scores, no correction bias, a group scored by its best expert (topk_method group_limited_greedy;
    greedy is one group), a choice weighing its score times `scaling`, never renormalised."""

    num_groups: int
    topk_groups: int
    scaling: float  # routed_scaling_factor
    shared_intermediate_size: int  # moe_intermediate_size x n_shared_experts
    scoring: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax" (DeepSeek-V2)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). A token's key and value come from one compressed
    latent (kv_lora_rank, after kv_a_layernorm) and one rope key shared by every head
    (qk_rope_head_dim): the KV cache holds those two per token and layer, not per-head K and V."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims come as (x0, x1), (x2, x3) pairs (transformers' rope_interleave)
    bias: bool  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj have biases

    @property
    def latent_dim(self) -> int:
        """Elements a token's cache entry holds per layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class FamilyFields:
    """The family-specific part of ModelConfig (what `Family.parse` returns)."""

    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head, before RoPE (Qwen3)
    moe: MoEConfig | None = None
    moe_routing: GroupedRouting | None = None  # None: softmax top-k (Mixtral, Qwen3-MoE)
    mla: MLAConfig | None = None  # None: per-head q/k/v attention
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma)
    sliding_layers: tuple[int, ...] = ()  # the layers that attend within sliding_window (served windowed)
    gemma: GemmaFields | None = None  # Gemma's layer (families/gemma3.py)
    # A family whose global and sliding layers rotate with their own RoPE (Gemma 3): config.json's
    # rope parameters of each, as flat dicts (rope_theta, rope_type, factor). None: config.json's own.
    rope_global: dict | None = None
    rope_local: dict | None = None


@dataclass(frozen=True)
class GemmaFields:
    """Gemma 3's layer: RMSNorms scale by (1 + weight); the embedding is scaled by sqrt(hidden); the
    attention and the MLP outputs are normed before each residual add (and the MLP's input after
    it); attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; the
    logits capped by tanh when final_logit_softcapping is set."""

    query_pre_attn_scalar: float
    final_logit_softcapping: float | None = None


@dataclass(frozen=True)
class Rename:
    """A checkpoint tensor (its name without "model.") whose name `pattern` matches (re.search) goes
    to the parameter named by replacing the match with `target`. `part`: its rows' place in a fused
    parameter (qkv_proj: q, k, v; gate_up_proj: gate, up); a named group `expert`: its slice of a
    stacked [num_experts, ...] parameter."""

    pattern: str
    target: str
    part: int | None = None


# q/k/v and gate/up are fused at load: one matmul each (the checkpoint keeps them apart).
FUSE_QKV_GATE_UP = (
    Rename(r"\.self_attn\.q_proj\.", ".self_attn.qkv_proj.", 0),
    Rename(r"\.self_attn\.k_proj\.", ".self_attn.qkv_proj.", 1),
    Rename(r"\.self_attn\.v_proj\.", ".self_attn.qkv_proj.", 2),
    Rename(r"\.mlp\.gate_proj\.", ".mlp.gate_up_proj.", 0),
    Rename(r"\.mlp\.up_proj\.", ".mlp.gate_up_proj.", 1),
)


@dataclass(frozen=True)
class Family:
    parse: Callable[[dict], FamilyFields]  # its own config.json fields; raises `unsupported` for what it cannot serve
    renames: tuple[Rename, ...] = FUSE_QKV_GATE_UP  # first match wins; an unmatched name is the parameter's own
    # Its layers are Llama's (norm, qkv(+bias), RoPE, attention, o, norm, gate_up, SiLU-mul, down): only
    # then may the fused CPU decode kernel (ops.decode_layers) run them.
    llama_shaped: bool = True
    tensor_parallel: bool = False  # distributed/ has its shard rules (plan, layers, shard_rules, loader)
    expert_size_field: str = "moe_intermediate_size"  # config.json's name of an expert's intermediate size (errors)
    expert_count_field: str = "num_experts"  # config.json's name of the routed experts' count (errors)
    cuda_graphs: bool = True  # a decode step never reads the device from the host, so a CUDA graph can capture it
    own_activation: bool = False  # its parse reads the MLP's activation itself (hidden_activation)
    defaults: tuple[tuple[str, object], ...] = ()  # transformers' values of the config.json fields it may omit
    # Checkpoint layers past num_hidden_layers are not the model's (DeepSeek-V3's multi-token prediction
    # module is stored as layer num_hidden_layers; transformers does not load it either): skipped.
    skips_extra_layers: bool = False


@dataclass(frozen=True)
class WeightQuant:
    """A block-scaled fp8 checkpoint (quant_method "fp8" with weight_block_size, as Qwen3-*-FP8 and
    DeepSeek-V3 ship): a quantised linear's `weight` is float8_e4m3fn [N, K] and its
    `weight_scale_inv` float32 [ceil(N / rows), ceil(K / cols)], the real weight being
    weight * weight_scale_inv block by block (the last block of a side may be partial). Loaded
    dequantized to the run dtype (model/fp8_weights.py). TODO(CUDA): keep the fp8 weights and their
    scales and run a scaled matmul (torch._scaled_mm with block scales) where a device is lent."""

    block: tuple[int, int]  # (rows, cols) of weight one scale covers


def parse_quantization(cfg: dict) -> WeightQuant | None:
    """config.json's quantization_config: None, or a block-scaled fp8 one; anything else refused, named."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    served = "only block-scaled fp8 checkpoints are served (quant_method fp8, fmt e4m3, activation_scheme " \
             "dynamic, weight_block_size [rows, cols])"
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise unsupported("quantization_config.quant_method", q.get("quant_method") if isinstance(q, dict) else q,
                          served)
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise unsupported("quantization_config.activation_scheme", q["activation_scheme"],
                          "static activation scales are not served; " + served)
    if q.get("fmt", "e4m3") != "e4m3":
        raise unsupported("quantization_config.fmt", q["fmt"], served)
    block = q.get("weight_block_size")
    if block is None:
        raise unsupported("quantization_config.weight_block_size", None,
                          "per-tensor fp8 weights are not served; " + served)
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise unsupported("quantization_config.weight_block_size", block,
                          "it must be two positive integers [rows, cols]")
    for field in ("kv_cache_scheme", "kv_cache_quant_algo"):
        if q.get(field):
            raise unsupported(f"quantization_config.{field}", q[field],
                              "checkpoint KV scales are not read; use engine.kv_cache_dtype fp8 (calibrated at load)")
    return WeightQuant((block[0], block[1]))


def check_common(cfg: dict, own_activation: bool = False) -> None:
    """Refuse what no family implements: another activation (unless the family reads its own),
    partial RoPE, MLP biases, attention kinds other than full or sliding (sliding is checked against
    the context at load). Quantised weights: parse_quantization."""
    for field in () if own_activation else ("hidden_act", "hidden_activation"):
        if cfg.get(field, "silu") != "silu":
            raise unsupported(field, cfg[field], "every served family's MLP is SiLU-gated")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise unsupported("partial_rotary_factor", factor, "RoPE rotates the whole head here")
    if cfg.get("mlp_bias"):
        raise unsupported("mlp_bias", True, "the MLP projections have no bias here")
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        raise unsupported("layer_types", sorted(kinds), "only full_attention and sliding_attention layers are served")


def sliding_window(cfg: dict) -> int | None:
    """The attention window some layer uses, or None. Qwen's configs switch it with use_sliding_window
    (and transformers 5 names the layers in layer_types); Mistral's apply sliding_window when set."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if "sliding_attention" in (cfg.get("layer_types") or ()):
        return window
    if "use_sliding_window" in cfg or "layer_types" in cfg:
        return window if cfg.get("use_sliding_window") else None
    return window


def required(cfg: dict, *names: str):
    """The first of `names` that config.json has (transformers renames some keys between versions)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ValueError(f"config.json lacks {' / '.join(names)}")
