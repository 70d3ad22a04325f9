"""What crosses between the pools: a peer's description and a request's KV handle."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.engine.kv_cache.hashing import BlockHash
from kv_transfer.errors import IncompatiblePeerError


MLA_LAYOUT = "block[L,1,bs,1,C+R]"  # latent attention's pool (cluster/engine/config.py kv_block_shape)
# KV dtypes a pull converts between (any pair); scaled ones carry per-layer K and V scales.
CONVERTIBLE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
SCALED_DTYPES = ("float8_e4m3fn",)


@dataclass(frozen=True)
class KVLayout:
    """Everything that must match for one engine's KV blocks to be read by another."""

    model_fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int  # the model's: each rank's pool holds rank_kv_heads of them (kv_transfer/head_map.py)
    head_dim: int
    layout: str = "block[L,2,bs,Hkv,D]"  # one block of all layers is one contiguous region, per rank
    tensor_parallel_size: int = 1  # ranks whose pools hold the model's KV heads
    # An fp8 pool's scales, float32 values: k, v of layer 0, then of layer 1, ... (stored = x / scale;
    # cluster/engine/attention/fp8_kv.py). Empty for a float pool (its values are themselves).
    kv_scales: tuple[float, ...] = ()
    # Latent attention (DeepSeek-V2/V3, MLA_LAYOUT): a token's entry per layer is its kv_lora_rank latent
    # and qk_rope_head_dim rope key, this many elements, shared by every query head and whole on every
    # rank; num_kv_heads is then 1 and head_dim latent_dim. 0: per-head K and V.
    latent_dim: int = 0

    @property
    def parts(self) -> int:
        """A block's parts per layer: K and V, or the one latent entry."""
        return 1 if self.latent_dim else 2

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One rank's block: [L, 2, bs, rank_kv_heads, D], or [L, 1, bs, 1, latent_dim]."""
        return (self.num_layers, self.parts, self.block_size, self.rank_kv_heads, self.head_dim)

    def describe(self) -> str:
        if self.latent_dim:
            return f"the MLA latent ({self.latent_dim} elements a token and layer)"
        return f"per-head K and V ({self.num_kv_heads} KV heads x {self.head_dim})"

    @property
    def rank_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tensor_parallel_size)  # split, or one head replicated

    @property
    def elem_bytes(self) -> int:
        import torch  # noqa: PLC0415

        return torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.elem_bytes

    def converts(self, peer: "KVLayout") -> bool:
        """Whether blocks read from `peer` must be converted into ours (kv_transfer/convert.py):
        another dtype, or other fp8 scales."""
        return (self.dtype, self.kv_scales) != (peer.dtype, peer.kv_scales)

    def check_compatible(self, peer: "KVLayout", peer_name: str) -> None:
        """Everything but the degree, the dtype and the scales must match; degrees that differ
        must map (head_map); dtypes that differ must both be ones a pull converts between."""
        if bool(self.latent_dim) != bool(peer.latent_dim):  # before the fingerprint: say what differs
            raise IncompatiblePeerError(f"refusing KV from {peer_name}: its blocks hold {peer.describe()} and ours "
                                        f"{self.describe()}: latent attention and GQA caches never mix")
        for field in ("model_fingerprint", "block_size", "num_layers", "num_kv_heads",
                      "head_dim", "layout", "latent_dim"):
            mine, theirs = getattr(self, field), getattr(peer, field)
            if mine != theirs:
                raise IncompatiblePeerError(
                    f"refusing KV from {peer_name}: {field} {theirs!r} != ours {mine!r}"
                )
        if self.converts(peer):
            self._check_conversion(peer, peer_name)
        if self.tensor_parallel_size != peer.tensor_parallel_size:
            from kv_transfer.head_map import head_map  # noqa: PLC0415

            try:
                head_map(self.num_kv_heads, peer.tensor_parallel_size, self.tensor_parallel_size)
            except IncompatiblePeerError as e:
                raise IncompatiblePeerError(f"refusing KV from {peer_name}: {e}") from None

    def _check_conversion(self, peer: "KVLayout", peer_name: str) -> None:
        for layout in (self, peer):
            if layout.dtype not in CONVERTIBLE_DTYPES:
                raise IncompatiblePeerError(f"refusing KV from {peer_name}: dtype {peer.dtype!r} != ours "
                                            f"{self.dtype!r}, and {layout.dtype!r} is not one a pull converts "
                                            f"({', '.join(CONVERTIBLE_DTYPES)})")
            if len(layout.kv_scales) != (layout.parts * layout.num_layers if layout.dtype in SCALED_DTYPES else 0):
                raise IncompatiblePeerError(f"refusing KV from {peer_name}: a {layout.dtype} layout with "
                                            f"{len(layout.kv_scales)} scales for {layout.num_layers} layers")
        if self.tensor_parallel_size != 1 or peer.tensor_parallel_size != 1:
            raise IncompatiblePeerError(f"refusing KV from {peer_name}: converting {peer.dtype} KV into "
                                        f"{self.dtype} is implemented between tensor_parallel_size 1 pools only")


@dataclass(frozen=True)
class RankPeer:
    """One tensor-parallel rank's registered pool: its own NIXL agent (rank 0's is the engine's)."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int


@dataclass(frozen=True)
class PeerInfo:
    """An engine's NIXL identity, published through a MetadataStore."""

    engine_id: str
    incarnation: str  # new on every start: a changed value invalidates cached agent state
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    kv_layout: KVLayout
    # A host tier the peer serves leases from (kv_tiers.lease_from_host; DRAM, like a CPU pool):
    # its slot s is descriptor num_blocks + s of the peer's list. 0 slots: none.
    host_base_addr: int = 0
    host_num_blocks: int = 0
    # Every rank's pool when tensor_parallel_size > 1 (rank 0 first, the fields above again); a
    # decode rank reads its heads from the ranks that hold them. Empty at tp=1.
    ranks: tuple[RankPeer, ...] = ()


@dataclass(frozen=True)
class KVHandle:
    """Prefill -> decode: where a request's prompt KV lives and until when it is held."""

    request_id: str
    engine_id: str
    incarnation: str
    agent_name: str
    # prefill-side blocks covering the prompt, in order: device block ids, or num_blocks + slot for
    # a block served from the peer's host tier (PeerInfo.host_num_blocks)
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]  # hashes of the prompt's full blocks
    num_prompt_tokens: int
    first_token: int
    kv_layout: KVLayout
    lease_expiry: float  # wall-clock (time.time()) after which the blocks may be gone
