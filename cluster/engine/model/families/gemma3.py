"""Gemma 3 text (gemma3_text), as transformers' Gemma3ForCausalLM: sliding-window layers interleaved
with global ones (layer_types, or every sliding_window_pattern-th layer global), each kind with its
own RoPE (rope_local_base_freq on the sliding layers; rope_scaling, linear served, on the global
ones), q/k RMSNorm, RMSNorms scaling by (1 + weight), the embedding scaled by sqrt(hidden), norms
after attention and around the MLP, a gelu_pytorch_tanh-gated MLP, attention scaled by
query_pre_attn_scalar ** -0.5 and the logits capped by final_logit_softcapping when set.

Refused, named: the multimodal gemma3 checkpoint, attn_logit_softcapping, bidirectional attention,
attention biases, another activation, a RoPE kind other than default/linear/llama3 per layer kind.
"""

from __future__ import annotations

from cluster.engine.model.families.base import Family, FamilyFields, GemmaFields, unsupported

ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers' Gemma3TextConfig defaults, for the fields a config.json may leave out.
DEFAULTS = (("tie_word_embeddings", True), ("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256),
            ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("rms_norm_eps", 1e-6),
            ("num_key_value_heads", 4), ("max_position_embeddings", 131072), ("bos_token_id", 2),
            ("eos_token_id", 1))


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind, as Gemma3TextConfig derives it when config.json does not list them."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise unsupported("layer_types", types, f"it must name each of the {layers} layers")
    return types


def rope_params(cfg: dict) -> tuple[dict, dict]:
    """(global, sliding) RoPE parameters: transformers 5's rope_parameters per layer kind, or the
    legacy rope_theta + rope_scaling (global) and rope_local_base_freq (sliding)."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and ("full_attention" in nested or "sliding_attention" in nested):
        full = dict(nested.get("full_attention") or {"rope_type": "default"})
        local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    else:
        full = dict(nested or {"rope_type": "default"}) | dict(cfg.get("rope_scaling") or {})
        local = {"rope_type": "default"}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported(f"rope_parameters.{kind}.partial_rotary_factor", params["partial_rotary_factor"],
                              "RoPE rotates the whole head here")
    return full, local


def _gemma3_text(cfg: dict) -> FamilyFields:
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise unsupported("hidden_activation", act, f"Gemma 3's MLP is served with {', '.join(ACTIVATIONS)}")
    for field, why in (("attn_logit_softcapping", "attention-score softcapping is not implemented"),
                       ("use_bidirectional_attention", "only causal attention is served"),
                       ("attention_bias", "Gemma 3 attention with biases is not implemented")):
        if cfg.get(field):
            raise unsupported(field, cfg[field], why)
    types = layer_types(cfg)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = cfg.get("sliding_window")
    if sliding and not (isinstance(window, int) and window >= 1):
        raise unsupported("sliding_window", window, "sliding_attention layers need a positive window")
    full, local = rope_params(cfg)
    gemma = GemmaFields(query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
                        final_logit_softcapping=cfg.get("final_logit_softcapping"))
    return FamilyFields(qk_norm=True, hidden_act=act, sliding_layers=sliding, gemma=gemma, rope_global=full,
                        rope_local=local)


# families/__init__.py names it in the refusal of model_type gemma3.
MULTIMODAL = ("the multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration: a vision tower and a "
              "text_config) is not served; a text-only gemma3_text checkpoint (Gemma3ForCausalLM) is")


# Gemma's checkpoint names are Llama's (q/k/v, gate/up apart; fused at load). Tensor-parallel as Llama
# (heads and MLP rows split; the q/k norms, per head_dim, and the four layer norms whole; a sliding
# layer's window is per layer, the same on every rank).
GEMMA3_TEXT = Family(parse=_gemma3_text, llama_shaped=False, own_activation=True, defaults=DEFAULTS,
                     tensor_parallel=True)
