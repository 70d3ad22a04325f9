"""The KV layout of a running engine, as the transfer layer describes it."""

from cluster.engine.llm_engine import LLMEngine
from kv_transfer.handle import MLA_LAYOUT, KVLayout


def engine_layout(engine: LLMEngine) -> KVLayout:
    mc = engine.model_config
    if mc.mla is not None:  # one entry a token and layer, the latent and rope key: a pull moves only those
        latent = mc.mla.latent_dim
        return KVLayout(model_fingerprint=engine.model_identity, block_size=engine.block_size,
                        dtype=str(engine.kv_cache.dtype).removeprefix("torch."), num_layers=mc.num_layers,
                        num_kv_heads=1, head_dim=latent, layout=MLA_LAYOUT,
                        tensor_parallel_size=engine.config.tensor_parallel_size, latent_dim=latent)
    return KVLayout(
        model_fingerprint=engine.model_identity,  # architecture + weights
        block_size=engine.block_size,
        dtype=str(engine.kv_cache.dtype).removeprefix("torch."),
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,  # the model's; a rank's pool holds KVLayout.rank_kv_heads
        head_dim=mc.head_dim,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        kv_scales=kv_scales(engine),
    )


def kv_scales(engine: LLMEngine) -> tuple[float, ...]:
    """The pool's fp8 scales flattened (k, v per layer), or () for a float pool."""
    quant = getattr(engine.model, "kv_quant", None)  # a tensor-parallel driver has none (fp8 is tp=1 only)
    return () if quant is None else tuple(s for pair in quant.scales for s in pair)
