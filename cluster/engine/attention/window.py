"""Sliding-window attention over the paged cache (Gemma 3's sliding layers).

A query at position i sees the keys at positions j with i - window < j <= i (transformers'
sliding_window_overlay on the causal mask). The pool keeps every block (a block holds every
layer's K/V, and the global layers read them all); a sliding layer's attention reads only the
blocks its window reaches:
- decodes: the kernels take `meta.window` and start at the block of position L - window (the
  CPU paged kernel, paged_decode_torch and the Triton kernel); the torch backend's groups
  (WindowedMetadata.decode_groups) gather only those blocks;
- a multi-token chunk (prefill, chunked prefill from the prefix cache, a decode with drafts): its
  span starts at the block of its first query's window, its mask causal within the window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from cluster.engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan


@dataclass(frozen=True)
class WindowedMetadata(AttentionMetadata):
    """A step as a sliding layer sees it (windowed())."""

    @cached_property
    def decode_groups(self) -> tuple[DecodeGroup, ...]:
        lens = self.decode_seq_lens if self.decode_seq_lens is not None else self.seq_lens[:self.num_decode].tolist()
        return window_decode_groups(self, lens)


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` as a layer attending within `window` positions sees it: the same writes, decode rows
    and tables (the kernels bound them by `window`), each multi-token chunk's span cut to its window.
    Built once a step (kept on `meta`) and shared by the step's sliding layers."""
    views = meta.__dict__.setdefault("_windowed", {})
    if window not in views:
        if window < 1:
            raise ValueError(f"sliding window {window} must be >= 1")
        spans = tuple(window_span(p, window, meta.block_size) for p in meta.prefills)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        views[window] = WindowedMetadata(**fields | {"prefills": spans, "window": window})
    return views[window]


def window_span(p: PrefillSpan, window: int, block_size: int) -> PrefillSpan:
    """The chunk's keys from the first block its first query's window reaches, masked causal
    within the window; unchanged when every row sees its whole context."""
    q0 = p.ctx_len - p.q_len  # the first query's position
    if p.ctx_len <= window:  # even the last query sees back to position 0
        return p
    first = max(0, q0 - window + 1) // block_size  # the first block any row's window reaches
    off = first * block_size
    dev = p.block_ids.device
    q_pos = torch.arange(q0, p.ctx_len, device=dev)[:, None]
    k_pos = torch.arange(off, p.ctx_len, device=dev)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return PrefillSpan(p.q_start, p.q_len, p.ctx_len - off, p.block_ids[first:], mask)


def window_decode_groups(meta: AttentionMetadata, lens: list[int] | tuple[int, ...]) -> tuple[DecodeGroup, ...]:
    """The decodes as one padded batch of their windows' blocks (every row needs at most
    ceil(window / block_size) + 1 of them): row r's table from the block of its first key."""
    nd, bs, w = meta.num_decode, meta.block_size, meta.window
    if nd == 0:
        return ()
    dev = meta.block_tables.device
    first = [max(0, n - w) // bs for n in lens]
    nb = max(-(-n // bs) - f for n, f in zip(lens, first))
    first_t = torch.tensor(first, device=dev)
    cols = (first_t[:, None] + torch.arange(nb, device=dev)[None, :]).clamp_(max=meta.block_tables.shape[1] - 1)
    tables = meta.block_tables[:nd].long().gather(1, cols)  # columns past a row's end are masked below
    key_pos = first_t[:, None] * bs + torch.arange(nb * bs, device=dev)[None, :]
    seq = meta.seq_lens[:nd, None]
    mask = (key_pos < seq) & (key_pos >= seq - w)
    return (DecodeGroup(0, nd, tables, mask.view(nd, 1, 1, nb * bs)),)
