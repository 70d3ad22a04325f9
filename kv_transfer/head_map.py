"""Which prefill rank holds each KV head a decode rank owns, when the pools' tensor-parallel degrees
differ (issue 41, KV transfer between degrees). The handshake checks a pair of degrees with it
(`KVLayout`, kv_transfer/handle.py) and the decode driver plans its ranks' READs from it
(kv_transfer/rank_reads.py).

A rank's pool holds its KV heads of every block (cluster/engine/distributed/plan.py): split when tp
divides the head count, one head replicated on tp / num_kv_heads ranks when tp is a multiple of it.
A block on a rank is [L, 2, bs, H_rank, D] (kv_transfer/handle.py's layout), so one head slice of a
block is L * 2 * bs runs of count * D elements, H_rank * D apart: `slice_runs` gives them as (byte
offset, length) within the block, merged where they touch (the whole block when the slice is every
head of the source rank). That is one side's runs; the READs pair both sides' runs in
rank_reads.slice_pairs, and only the tests call `slice_runs`. No torch, no NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.distributed.plan import kv_heads_per_rank
from kv_transfer.errors import IncompatiblePeerError


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_head, src_head + count) of prefill rank `src_rank`'s pool go to heads
    [dst_head, dst_head + count) of the decode rank's pool (pool-local head indices)."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads that `rank` of a tp-way pool holds."""
    n = kv_heads_per_rank(num_kv_heads, tp)
    replicas = max(1, tp // num_kv_heads)
    start = (rank // replicas) * n
    return range(start, start + n)


def check_degree(num_kv_heads: int, tp: int, side: str) -> None:
    ok = num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0
    if tp < 1 or not ok:
        raise IncompatiblePeerError(
            f"cannot map KV heads: the {side} pool's tensor_parallel_size {tp} neither divides the model's "
            f"{num_kv_heads} KV heads nor is a multiple of them")


def head_map(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[list[HeadSlice]]:
    """For each decode rank (dst), the slices it reads, in its own head order. A head replicated on
    several prefill ranks is read from one of them, chosen by the decode rank's index so that the
    decode ranks spread over the replicas."""
    check_degree(num_kv_heads, src_tp, "prefill")
    check_degree(num_kv_heads, dst_tp, "decode")
    src_replicas = max(1, src_tp // num_kv_heads)
    out = []
    for dst in range(dst_tp):
        slices: list[HeadSlice] = []
        for dst_head, head in enumerate(rank_heads(num_kv_heads, dst_tp, dst)):
            n_src = kv_heads_per_rank(num_kv_heads, src_tp)
            src = (head // n_src) * src_replicas + dst % src_replicas
            src_head = head - rank_heads(num_kv_heads, src_tp, src).start
            last = slices[-1] if slices else None
            if last and last.src_rank == src and last.src_head + last.count == src_head \
                    and last.dst_head + last.count == dst_head:
                slices[-1] = HeadSlice(src, last.src_head, last.dst_head, last.count + 1)
            else:
                slices.append(HeadSlice(src, src_head, dst_head, 1))
        out.append(slices)
    return out


def slice_runs(rows: int, heads: int, first: int, count: int, head_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) in bytes, within one block of `rows` = L * 2 * bs rows of `heads` heads
    (head_bytes = D x element size), of heads [first, first + count); adjacent runs merged."""
    if not 0 <= first < first + count <= heads:
        raise ValueError(f"heads [{first}, {first + count}) are outside a pool of {heads}")
    if count == heads:
        return [(0, rows * heads * head_bytes)]
    row = heads * head_bytes
    return [(r * row + first * head_bytes, count * head_bytes) for r in range(rows)]
