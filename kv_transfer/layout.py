"""The KV layout of a running engine, as the transfer layer describes it."""

from cluster.engine.llm_engine import LLMEngine
from kv_transfer.handle import KVLayout


def engine_layout(engine: LLMEngine) -> KVLayout:
    mc = engine.model_config
    return KVLayout(
        model_fingerprint=engine.model_identity,  # architecture + weights
        block_size=engine.block_size,
        dtype=str(engine.dtype).removeprefix("torch."),
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,  # the model's; a rank's pool holds KVLayout.rank_kv_heads
        head_dim=mc.head_dim,
        tensor_parallel_size=engine.config.tensor_parallel_size,
    )
