"""Pulls between pools of different KV dtypes or fp8 scales: READ into staging, convert into the pool.

A peer's blocks whose layout differs from ours in dtype or scales (KVLayout.converts: a bf16
prefill pool and an fp8 decode pool, either way round) cannot land in our blocks as bytes. The
decode side keeps, per peer dtype, a staging arena registered with NIXL like the pool, its slots
laid out as the peer's blocks. A converting pull takes one slot per block (waiting in poll while
too few are free), READs the peer's blocks into them, and once the READ is done converts each
block into its pool block: dequantize with the peer's scales (a float pool's values are
themselves), then quantize with ours (cluster/engine/attention/fp8_kv.py: the same product by a
float32 inverse scale a layer's KV write uses, so a bf16 block converts to exactly the bytes an
fp8 engine writes for the same K/V) or cast to our float dtype. The slots go back once the READ
has settled: done and converted, failed, or cancelled (an abandoned READ keeps them till then).

The arena holds STAGING_SHARE of the pool's bytes (at least MIN_STAGING_SLOTS slots), made on the
first pull from a peer of that dtype; a pull of more blocks than the whole arena is refused
(KVTransferError: the decode role's failure policy recomputes it).
"""

from __future__ import annotations

import logging

import torch

from cluster.engine.attention.fp8_kv import dequantize, f32, quantize
from kv_transfer.errors import KVTransferError
from kv_transfer.handle import SCALED_DTYPES, KVLayout
from kv_transfer.runs import BlockSpace, block_runs

log = logging.getLogger(__name__)

STAGING_SHARE = 1 / 8
MIN_STAGING_SLOTS = 64
CONVERT_CHUNK = 16  # blocks converted per float32 temporary


def layer_scales(layout: KVLayout, device: torch.device) -> torch.Tensor:
    """[L, parts] float32: each layer's K and V scale (1.0 for a float pool), broadcast over a block's
    [bs, H_kv, D]."""
    if layout.dtype not in SCALED_DTYPES:
        return torch.ones(layout.num_layers, layout.parts, 1, 1, 1, device=device)
    return torch.tensor(layout.kv_scales, dtype=torch.float32, device=device).view(layout.num_layers, layout.parts,
                                                                                   1, 1, 1)


class Staging:
    """Slots laid out as one peer dtype's blocks, registered with the decode engine's agent."""

    def __init__(self, agent, mem_type: str, device_id: int, peer: KVLayout, slots: int, device: torch.device):
        self.agent = agent
        self.tensor = torch.zeros(slots, *peer.block_shape, dtype=getattr(torch, peer.dtype), device=device)
        self.reg = agent.register_memory(self.tensor)
        space = BlockSpace((self.tensor.data_ptr(),), (slots,), peer.block_bytes, device_id)
        self.dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", space.block_descs(), mem_type)
        self.slots = slots
        self.free = list(range(slots - 1, -1, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken, self.free = self.free[-n:], self.free[:-n]
        return taken[::-1]

    def give(self, slots: list[int]) -> None:
        self.free += slots

    def close(self) -> None:
        try:
            self.agent.release_dlist_handle(self.dlist)
            self.agent.deregister_memory(self.reg)
        except Exception as e:  # noqa: BLE001 — closing: nothing left to do about it
            log.debug("releasing a staging arena: %s", e)


class Conversion:
    """One converting pull: where its blocks are staged and where they go."""

    def __init__(self, staging: Staging, peer: KVLayout, remote_blocks: list[int], local_blocks: list[int]):
        self.staging, self.peer = staging, peer
        self.remote_blocks, self.local_blocks = remote_blocks, local_blocks
        self.slots: list[int] | None = None  # taken when the READ is posted

    def post(self, agent, remote_dlist, remote_sizes) -> object | None:
        """Take slots and post the READ into them; None while the arena has too few free."""
        self.slots = self.staging.take(len(self.remote_blocks))
        if self.slots is None:
            return None
        runs = block_runs(self.slots, self.remote_blocks, (self.staging.slots,), remote_sizes)
        local, remote = runs.indices()
        return agent.make_prepped_xfer("READ", self.staging.dlist, local, remote_dlist, remote)

    def release(self) -> None:
        if self.slots is not None:
            self.staging.give(self.slots)
            self.slots = None


class Converter:
    """The decode side's staging arenas (one per peer dtype) and the conversion into its pool."""

    def __init__(self, agent, pool: torch.Tensor, layout: KVLayout, mem_type: str, device_id: int):
        self.agent, self.pool, self.layout = agent, pool, layout
        self.mem_type, self.device_id = mem_type, device_id
        self._staging: dict[str, Staging] = {}
        self._inv = None  # [L, 2, 1, 1, 1]: our fp8 inverse scales, the float32 values a layer's write uses
        if layout.dtype in SCALED_DTYPES:
            self._inv = torch.tensor([f32(1.0 / s) for s in layout.kv_scales], device=pool.device).view(
                layout.num_layers, layout.parts, 1, 1, 1)

    def begin(self, peer: KVLayout, remote_blocks: list[int], local_blocks: list[int], peer_name: str) -> Conversion:
        staging = self._staging.get(peer.dtype)
        if staging is None:
            pool_bytes = self.pool.shape[0] * self.layout.block_bytes
            slots = max(MIN_STAGING_SLOTS, int(pool_bytes * STAGING_SHARE // peer.block_bytes))
            staging = self._staging[peer.dtype] = Staging(self.agent, self.mem_type, self.device_id, peer, slots,
                                                          self.pool.device)
            log.info("KV staging for %s pulls: %d slots (%.1f MiB)", peer.dtype, slots,
                     slots * peer.block_bytes / 2**20)
        if len(remote_blocks) > staging.slots:
            raise KVTransferError(f"READ from {peer_name} not posted: converting {len(remote_blocks)} {peer.dtype} "
                                  f"blocks needs more than the staging arena's {staging.slots} slots")
        return Conversion(staging, peer, remote_blocks, local_blocks)

    def finish(self, conv: Conversion) -> None:
        """The READ is done: convert the staged blocks into their pool blocks, free the slots."""
        theirs = layer_scales(conv.peer, self.pool.device)
        staged = conv.staging.tensor
        for i in range(0, len(conv.slots), CONVERT_CHUNK):
            src = torch.tensor(conv.slots[i:i + CONVERT_CHUNK], device=self.pool.device)
            dst = torch.tensor(conv.local_blocks[i:i + CONVERT_CHUNK], device=self.pool.device)
            values = dequantize(staged.index_select(0, src), theirs, torch.float32)  # [n, L, 2, bs, H, D]
            if self._inv is not None:
                self.pool[dst] = quantize(values, self._inv)
            else:
                self.pool[dst] = values.to(self.pool.dtype)
        conv.release()

    def close(self) -> None:
        for staging in self._staging.values():
            staging.close()
        self._staging.clear()
