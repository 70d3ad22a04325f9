"""Turns a scheduled step into tensors, runs the model once, samples.

The runner reads block tables handed to it; it never sees the block pool.
"""

from __future__ import annotations

import torch

from cluster.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from cluster.model.llama import LlamaForCausalLM
from cluster.sampler import Sampler
from cluster.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        seed: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed)

    def execute(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> dict[str, int]:
        """Run one step. Returns the sampled token of every chunk that reaches its request's end."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, logits_idx, samplers = self._flatten(ordered)
        meta = self._metadata(decodes, prefills, block_tables)
        dev = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_cache, meta, self.backend,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        requests = [c.request for c in samplers]
        tokens = self.sampler.sample(logits, requests)
        return {r.request_id: t for r, t in zip(requests, tokens)}

    @staticmethod
    def _flatten(chunks: list[ScheduledChunk]):
        input_ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        samplers: list[ScheduledChunk] = []
        for c in chunks:
            input_ids += c.request.all_token_ids[c.start : c.start + c.num_tokens]
            positions += range(c.start, c.start + c.num_tokens)
            if c.samples:
                logits_idx.append(len(input_ids) - 1)
                samplers.append(c)
        return input_ids, positions, logits_idx, samplers

    def _metadata(self, decodes, prefills, block_tables) -> AttentionMetadata:
        bs, dev = self.block_size, self.device
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        all_tables: list[list[int]] = []
        seq_lens: list[int] = []
        q_lens: list[int] = []
        for c in decodes + prefills:
            table = block_tables[c.request.request_id]
            for pos in range(c.start, c.start + c.num_tokens):
                slot_blocks.append(table[pos // bs])
                slot_offsets.append(pos % bs)
            ctx = c.start + c.num_tokens
            all_tables.append(table[: -(-ctx // bs)])
            seq_lens.append(ctx)
            q_lens.append(c.num_tokens)

        nd = len(decodes)
        max_blocks = max((len(t) for t in all_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in all_tables]
        tables = torch.tensor(padded, dtype=torch.long, device=dev).view(len(padded), max_blocks)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        max_dec_blocks = max((len(t) for t in all_tables[:nd]), default=0)
        decode_tables = tables[:nd, :max_dec_blocks]
        key_pos = torch.arange(max_dec_blocks * bs, device=dev)
        decode_mask = (key_pos[None, :] < lens[:nd, None]).view(nd, 1, 1, max_dec_blocks * bs)

        spans = []
        q_start = nd
        for c, table in zip(prefills, all_tables[nd:]):
            ctx = c.start + c.num_tokens
            mask = None
            if c.start > 0:
                q_pos = torch.arange(c.start, ctx, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(q_start, c.num_tokens, ctx, torch.tensor(table, device=dev), mask))
            q_start += c.num_tokens

        cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=cu_q[1:])
        return AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            num_decode=nd,
            decode_block_tables=decode_tables,
            decode_seq_lens=lens[:nd],
            decode_mask=decode_mask,
            prefills=tuple(spans),
            cu_seqlens_q=cu_q.to(dev),
            seq_lens=lens,
            block_tables=tables.to(torch.int32),
            max_q_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
