"""Turns a scheduled step into tensors, runs the model once, samples.

The runner reads block tables handed to it; it never sees the block pool.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from cluster.engine.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.grammar import Grammars
from cluster.engine.outputs import TokenLogprob
from cluster.engine.request import Request
from cluster.engine.sampler import Sampler, SamplerOutput
from cluster.engine.scheduler import ScheduledChunk
from cluster.engine.static_decode import StaticDecode


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        seed: int,
        grammars: Grammars | None = None,
        static: StaticDecode | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed, grammars)
        self.static = static  # decode-only steps on fixed shapes (CUDA graphs); None: every step dynamic

    def release_static(self, request_id: str) -> None:
        """The request's blocks went (it ended, or was preempted): its static row is free."""
        if self.static is not None:
            self.static.forget(request_id)

    def execute(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
                while_running: Callable[[], None] | None = None) -> SamplerOutput:
        """Run one step. Every chunk that reaches its request's end gets a sampled token, or a
        failure of its own (the others are unaffected); raises only when the step as a whole fails.
        `while_running` is called once the forward is launched and before the sampler reads its
        result: on a GPU, host work done there overlaps the device's (the engine's async output)."""
        if self.static is not None:
            if self.static.takes(chunks):
                logits = self.static.run(chunks, block_tables)
                if while_running is not None:
                    while_running()
                return self.sampler.sample(logits, [c.request for c in chunks])
            for c in chunks:  # a multi-token step: the row is rewritten whole when it decodes again
                if c.num_tokens > 1:
                    self.static.forget(c.request.request_id)
        decodes, prefills = self._step_order(chunks)
        ordered = decodes + prefills
        input_ids, positions, logits_idx, samplers, scored = self._flatten(ordered)
        meta = self._metadata(decodes, prefills, block_tables)
        dev = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_cache, meta, self.backend,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        if while_running is not None:
            while_running()
        if scored:  # the rows after the sampling rows score prompt tokens
            logits = self._score_prompts(logits, scored)
        if not any(c.draft for c in samplers):
            return self.sampler.sample(logits, [c.request for c in samplers])
        return self._sample_with_drafts(logits, samplers)

    def last_logits(self, spans: Sequence[tuple[Request, int, Sequence[int]]],
                    block_tables: dict[str, list[int]]) -> torch.Tensor:
        """One forward over `spans` (request, first position, token ids at the positions from
        there, over the KV the request already has before it) -> [len(spans), vocab], the
        logits after each span's last token, in span order. No sampling and no prompt scoring:
        the draft model's step (cluster/engine/spec/draft.py), whose spans are either a catch-up
        (every token the draft has not seen yet) or one draft token."""
        chunks = [ScheduledChunk(req, start, len(tokens), True) for req, start, tokens in spans]
        tokens_of = {id(c): tokens for c, (_, _, tokens) in zip(chunks, spans)}
        decodes, prefills = self._step_order(chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}
        for c in decodes + prefills:
            input_ids += tokens_of[id(c)]
            positions += range(c.start, c.start + c.num_tokens)
            last_row[id(c)] = len(input_ids) - 1
        last_rows = [last_row[id(c)] for c in chunks]
        meta = self._metadata(decodes, prefills, block_tables)
        dev = self.device
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_cache, meta, self.backend,
            torch.tensor(last_rows, dtype=torch.long, device=dev),
        )

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
    def _step_order(chunks: Sequence[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """(decodes, multi-token chunks), the order a step's rows take: decodes longest context
        first, so length groups are contiguous runs of the decode tokens."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.start)
        return decodes, [c for c in chunks if c.num_tokens > 1]

    @staticmethod
    def _flatten(chunks: list[ScheduledChunk]):
        """The step's tokens and positions, and the rows whose logits are wanted: the sampling
        rows (in `samplers` order), then the rows that score prompt tokens (`scored`: per row,
        its request and the prompt position whose token it scores)."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        samplers: list[ScheduledChunk] = []
        score_idx: list[int] = []
        scored: list[tuple[Request, int]] = []
        if all(c.num_tokens == 1 and c.samples and c.request.prompt_logprobs is None for c in chunks):
            # A decode-only step (the common one, at every batch size): one token per request at
            # its position, every row sampled. The general loop below costs ~4x this per request.
            return ([c.request.all_token_ids[c.start] for c in chunks], [c.start for c in chunks],
                    list(range(len(chunks))), list(chunks), [])
        for c in chunks:
            known = c.num_tokens - len(c.draft)  # a speculative chunk: the last token, then its drafts
            base = len(input_ids)
            input_ids += c.request.all_token_ids[c.start : c.start + known]
            input_ids += c.draft
            positions += range(c.start, c.start + c.num_tokens)
            if c.samples:
                logits_idx.extend(range(len(input_ids) - 1 - len(c.draft), len(input_ids)))
                samplers.append(c)
            lps = c.request.prompt_logprobs
            if lps is not None:
                # position p's logits score prompt token p + 1; the last prompt position's are the
                # sampling row. A recomputed (preempted) prompt is not scored twice.
                end = min(c.start + known, c.request.num_prompt_tokens - 1)
                for p in range(max(c.start, len(lps) - 1), end):
                    score_idx.append(base + p - c.start)
                    scored.append((c.request, p + 1))
        return input_ids, positions, logits_idx + score_idx, samplers, scored

    @staticmethod
    def _score_prompts(logits: torch.Tensor, scored: list[tuple[Request, int]]) -> torch.Tensor:
        """Append each scored prompt token's raw logprob and top k (the request's prompt_logprobs)
        to its request; return the sampling rows. One log_softmax, gather and topk for the step."""
        n = logits.shape[0] - len(scored)
        lp = torch.log_softmax(logits[n:], dim=-1)
        targets = torch.tensor([r.prompt_token_ids[i] for r, i in scored], device=lp.device)
        k = min(max(r.sampling.prompt_logprobs for r, _ in scored), lp.shape[1])
        top_lp, top_ids = (x.tolist() for x in lp.topk(k, dim=-1))
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        for j, (r, i) in enumerate(scored):
            kr = r.sampling.prompt_logprobs
            r.prompt_logprobs.append(TokenLogprob(r.prompt_token_ids[i], chosen[j],
                                                  tuple(zip(top_ids[j][:kr], top_lp[j][:kr]))))
        return logits[:n]

    def _metadata(self, decodes, prefills, block_tables) -> AttentionMetadata:
        # Host work is one pass over the step's requests (and the new tokens' slots); the
        # tensors are built from flat lists in one call each.
        bs, dev = self.block_size, self.device
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        used: list[list[int]] = []  # each request's blocks up to its context end
        seq_lens: list[int] = []
        q_lens: list[int] = []
        for c in decodes:
            table = block_tables[c.request.request_id]
            pos = c.start
            slot_blocks.append(table[pos // bs])
            slot_offsets.append(pos % bs)
            used.append(table[: pos // bs + 1])
            seq_lens.append(pos + 1)
            q_lens.append(1)
        for c in prefills:
            table = block_tables[c.request.request_id]
            ctx = c.start + c.num_tokens
            for pos in range(c.start, ctx):
                slot_blocks.append(table[pos // bs])
                slot_offsets.append(pos % bs)
            used.append(table[: -(-ctx // bs)])
            seq_lens.append(ctx)
            q_lens.append(c.num_tokens)

        width = max((len(t) for t in used), default=0)
        flat = [b for t in used for b in (t + [0] * (width - len(t)) if len(t) < width else t)]
        tables = torch.tensor(flat, dtype=torch.int32, device=dev).view(len(used), width)
        nd = len(decodes)
        spans = []
        q_start = nd
        for c, table in zip(prefills, used[nd:]):
            ctx = c.start + c.num_tokens
            mask = None
            if c.start > 0:
                q_pos = torch.arange(c.start, ctx, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(q_start, c.num_tokens, ctx, torch.tensor(table, device=dev), mask))
            q_start += c.num_tokens

        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        return AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            num_decode=nd,
            prefills=tuple(spans),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables,
            max_q_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=bs,
            decode_seq_lens=tuple(seq_lens[:nd]),
        )
