"""Per-step attention metadata, built once per step and shared by every layer.

Token layout of a step: the decode tokens first (one per decoding request, longest context
first), then each multi-token chunk's tokens contiguously (prefill chunks; a decode with drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

MAX_DECODE_GROUPS = 4


@dataclass(frozen=True)
class PrefillSpan:
    q_start: int  # offset of this chunk's first token in the step's flat token array
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached + earlier chunks + this one)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when the chunk is the whole context (causal)
    # ctx_len == q_len: the keys are the chunk's own (attended from its fresh K/V, not the pool)


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
    # The decodes' context lengths as host ints (the runner has them): decode_groups plans from
    # these rather than reading seq_lens back (on a GPU, a sync every step). None: read seq_lens.
    decode_seq_lens: tuple[int, ...] | None = None
    # A sliding-window layer's view (attention/window.py: windowed(meta, W)): a query at position i
    # sees keys j with i - window < j <= i, and no block wholly before its window is read. 0: full.
    window: int = 0

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
        host = self.decode_seq_lens if self.decode_seq_lens is not None else lens.tolist()
        blocks = [-(-n // bs) for n in host]
        groups = []
        for start, end in partition_by_length(blocks, MAX_DECODE_GROUPS):
            nb = blocks[start]  # the longest in the group
            key_pos = torch.arange(nb * bs, device=lens.device)
            mask = (key_pos[None, :] < lens[start:end, None]).view(end - start, 1, 1, nb * bs)
            groups.append(DecodeGroup(start, end, self.block_tables[start:end, :nb].long(), mask))
        return tuple(groups)


def partition_by_length(blocks: list[int], max_groups: int) -> list[tuple[int, int]]:
    """Split a descending list of per-request block counts into <= max_groups contiguous runs,
    minimising the padded blocks read (sum over groups of size * longest); among equal costs the
    fewest groups, and the earliest cut (the DP's first minimum).

    Planned every decode step, so it must stay cheap at hundreds of requests: the pure-Python DP
    this replaces was O(n^2 * groups) interpreted steps (3.4 ms at 128 decodes, 14 ms at 256, the
    largest host cost of such a step). One length (the common case, and every step of a batch
    that started together) is one group, which the DP finds too; other lists take the same DP
    as [n, n + 1] integer tensor ops per group count (exact: integer costs, first minimum), and a
    list seen recently (block counts change every block_size steps) is looked up."""
    n = len(blocks)
    if n == 0:
        return []
    if blocks[0] == blocks[-1]:  # descending: all equal, one group costs what any split does
        return [(0, n)]
    return list(_partition(tuple(blocks), max_groups))


_INF = 1 << 60  # an unreachable cell's cost (sums of two stay below int64's limit)


@lru_cache(maxsize=64)
def _partition(blocks: tuple[int, ...], max_groups: int) -> tuple[tuple[int, int], ...]:
    """cost[g][i]: least padded area covering the first i requests with exactly g groups; the
    last group is j..i-1 and costs (i - j) * blocks[j]. Each g is one [n, n + 1] min over j."""
    n = len(blocks)
    b = torch.tensor(blocks, dtype=torch.long)
    j = torch.arange(n)[:, None]
    i = torch.arange(n + 1)[None, :]
    area = torch.where(j < i, (i - j) * b[:, None], _INF)  # [j, i]: the last group j..i-1's cost
    prev = torch.full((n + 1,), _INF, dtype=torch.long)
    prev[0] = 0
    costs, cuts = [], []
    for _ in range(max_groups):
        total = prev[:n, None] + area
        cut = total.argmin(dim=0)  # the first j at the minimum, as the scalar DP's strict <
        prev = total.gather(0, cut[None])[0].clamp_(max=_INF)
        costs.append(int(prev[n]))
        cuts.append(cut.tolist())
    g = min(range(1, max_groups + 1), key=lambda k: (costs[k - 1], k))
    bounds, end = [], n
    while end > 0:
        start = cuts[g - 1][end]
        bounds.append((start, end))
        end, g = start, g - 1
    return tuple(bounds[::-1])
