"""Per-step attention metadata, built once per step and shared by every layer.

Token layout of a step: the decode tokens first (one per decoding request, longest context
first), then each multi-token chunk's tokens contiguously (prefill chunks; a decode with drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

MAX_DECODE_GROUPS = 4


@dataclass(frozen=True)
class PrefillSpan:
    q_start: int  # offset of this chunk's first token in the step's flat token array
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached + earlier chunks + this one)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when the chunk is the whole context


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended as one padded batch."""

    start: int  # first decode token of the group in the step's flat token array
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: key position < context length


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] long: block id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    num_decode: int
    prefills: tuple[PrefillSpan, ...]
    # Inputs for kernels that take a batch as cumulative lengths (flash-attn varlen, cpu_paged).
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 over (decodes, then prefills)
    seq_lens: torch.Tensor  # [B] int32 context lengths
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_q_len: int
    max_seq_len: int
    block_size: int

    @cached_property
    def row_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token row as a decode of its own: (block tables [T, max_blocks] int32, context
        lengths [T] int32). Row j of a chunk that ends at context length L (q_len n) sees L - n + 1 + j
        tokens, its own K/V written before attention: causal within the chunk. For kernels that
        attend row by row (ops.decode_layers); a decode-only step's are its own tables."""
        if self.max_q_len == 1:
            return self.block_tables, self.seq_lens
        q_lens = self.cu_seqlens_q.diff()
        rows = self.slot_blocks.shape[0]  # one new token's slot per row
        after = self.cu_seqlens_q[1:].repeat_interleave(q_lens, output_size=rows)  # the row's chunk's end
        lens = self.seq_lens.repeat_interleave(q_lens, output_size=rows)
        lens = lens - (after - 1 - torch.arange(rows, device=lens.device, dtype=after.dtype))
        return self.block_tables.repeat_interleave(q_lens, dim=0, output_size=rows), lens.to(torch.int32)

    @cached_property
    def decode_groups(self) -> tuple[DecodeGroup, ...]:
        """The decodes in <= MAX_DECODE_GROUPS padded batches of similar length (the torch
        backend's plan; computed on first use, so backends that read the pool in place skip it)."""
        nd, bs = self.num_decode, self.block_size
        lens = self.seq_lens[:nd]
        blocks = [-(-n // bs) for n in lens.tolist()]
        groups = []
        for start, end in partition_by_length(blocks, MAX_DECODE_GROUPS):
            nb = blocks[start]  # the longest in the group
            key_pos = torch.arange(nb * bs, device=lens.device)
            mask = (key_pos[None, :] < lens[start:end, None]).view(end - start, 1, 1, nb * bs)
            groups.append(DecodeGroup(start, end, self.block_tables[start:end, :nb].long(), mask))
        return tuple(groups)


def partition_by_length(blocks: list[int], max_groups: int) -> list[tuple[int, int]]:
    """Split a descending list of per-request block counts into <= max_groups contiguous runs,
    minimising the padded blocks read (sum over groups of size * longest). O(n^2 * groups)."""
    n = len(blocks)
    if n == 0:
        return []
    inf = float("inf")
    # cost[g][i]: least padded area covering the first i requests with g groups
    cost = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    cost[0][0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, n + 1):
            for j in range(i):  # last group is j..i-1, its longest is blocks[j]
                c = cost[g - 1][j] + (i - j) * blocks[j]
                if c < cost[g][i]:
                    cost[g][i], cut[g][i] = c, j
    g = min(range(1, max_groups + 1), key=lambda k: (cost[k][n], k))
    bounds, i = [], n
    while i > 0:
        j = cut[g][i]
        bounds.append((j, i))
        i, g = j, g - 1
    return bounds[::-1]
