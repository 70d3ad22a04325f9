"""Turns a scheduled step into tensors, runs the model once, samples.

The runner reads block tables handed to it; it never sees the block pool.
"""

from __future__ import annotations

import torch

from cluster.engine.attention import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan
from cluster.engine.model.llama import LlamaForCausalLM
from cluster.engine.grammar import Grammars
from cluster.engine.sampler import Sampler, SamplerOutput
from cluster.engine.scheduler import ScheduledChunk


MAX_DECODE_GROUPS = 4


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


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        seed: int,
        grammars: Grammars | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed, grammars)

    def execute(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> SamplerOutput:
        """Run one step. Every chunk that reaches its request's end gets a sampled token, or a
        failure of its own (the others are unaffected); raises only when the step as a whole fails."""
        # Longest context first, so length groups are contiguous runs of the decode tokens.
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.start)
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
        if not any(c.draft for c in samplers):
            return self.sampler.sample(logits, [c.request for c in samplers])
        return self._sample_with_drafts(logits, samplers)

    def _sample_with_drafts(self, logits: torch.Tensor, samplers: list[ScheduledChunk]) -> SamplerOutput:
        """A speculative chunk has 1 + len(draft) logits rows (in `samplers` order), the others one."""
        plain_rows, spec_rows, row = [], [], 0
        for c in samplers:
            (spec_rows if c.draft else plain_rows).extend(range(row, row + 1 + len(c.draft)))
            row += 1 + len(c.draft)
        dev = logits.device
        out = self.sampler.verify(logits[torch.tensor(spec_rows, device=dev)],
                                  [(c.request, c.draft) for c in samplers if c.draft])
        plain = [c.request for c in samplers if not c.draft]
        if plain:
            rest = self.sampler.sample(logits[torch.tensor(plain_rows, device=dev)], plain)
            out.tokens.update(rest.tokens)
            out.failed.update(rest.failed)
            out.logprobs.update(rest.logprobs)
        return out

    @staticmethod
    def _flatten(chunks: list[ScheduledChunk]):
        input_ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        samplers: list[ScheduledChunk] = []
        for c in chunks:
            known = c.num_tokens - len(c.draft)  # a speculative chunk: the last token, then its drafts
            input_ids += c.request.all_token_ids[c.start : c.start + known]
            input_ids += c.draft
            positions += range(c.start, c.start + c.num_tokens)
            if c.samples:
                logits_idx.extend(range(len(input_ids) - 1 - len(c.draft), len(input_ids)))
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
        groups = []
        for start, end in partition_by_length([len(t) for t in all_tables[:nd]], MAX_DECODE_GROUPS):
            nb = len(all_tables[start])  # the longest in the group
            key_pos = torch.arange(nb * bs, device=dev)
            mask = (key_pos[None, :] < lens[start:end, None]).view(end - start, 1, 1, nb * bs)
            groups.append(DecodeGroup(start, end, tables[start:end, :nb], mask))

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
            decode_groups=tuple(groups),
            prefills=tuple(spans),
            cu_seqlens_q=cu_q.to(dev),
            seq_lens=lens,
            block_tables=tables.to(torch.int32),
            max_q_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
