"""The draft-model proposer: a smaller checkpoint with the model's vocabulary proposes greedily.

The draft runs on the engine's own model code (a second `DecoderForCausalLM` and `ModelRunner`,
same device, dtype, attention backend and block size) over its own paged KV pool, accounted by a
second `KVCacheManager` (no prefix cache: a draft block never outlives its request). Draft
proposals are its argmax, so each is a point mass: verify.py's rejection sampling (accept x with
probability p(x), else sample p without x, renormalised) keeps the model's distribution exactly.

Per request the proposer remembers how far the draft's KV reaches (`_DraftSeq`), nothing else:
- Lazily built. A request's draft KV is computed the first time it speculates here: after a P/D
  handoff, a migration or a preemption (which frees it) the draft catches up by computing every
  token it has not seen in one forward, batched with the other requests' first draft position.
  Nothing moves with the model's KV.
- One `propose_batch` is k_max batched forwards, not one per request: forward 1 computes each
  request's unseen tokens (usually the one appended last step; two when all drafts were
  accepted; all of them after a handoff) and gives d_1; forward j computes d_(j-1) for the
  requests that want a j-th draft and gives d_j. d_1 .. d_(k-1) get KV, d_k does not (if it is
  accepted, the next catch-up computes it).
- Rolled back after the step (`rollback`, once verified or dropped): the KV stays valid for the tokens the request
  actually has (the drafts that were accepted, or happen to equal what was sampled); the blocks
  past them go back to the draft pool (KVCacheManager.trim), so a request holds exactly
  ceil(valid tokens / block_size) draft blocks between steps.
- Freed (`release`) when the request leaves the engine: finished, aborted, failed, preempted,
  migrated away (the engine's scheduler calls it wherever it frees the model's blocks).
A request the draft pool has no room for gets no drafts that step (never an error), and gives
its draft KV back for the others: it tries again from scratch (a catch-up) the next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from cluster.engine.attention import AttentionBackend
from cluster.engine.config import kv_block_shape
from cluster.engine.kv_cache import KVCacheManager
from cluster.engine.model.hub import resolve_checkpoint
from cluster.engine.model.loader import load_model
from cluster.engine.model.ops import CPUKernelOps, TorchOps
from cluster.engine.model_config import ModelConfig
from cluster.engine.model_runner import ModelRunner
from cluster.engine.request import Request
from cluster.engine.spec.proposer import Proposer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _DraftSeq:
    """One request's draft KV, as the KV manager sees a request (KVRequest): its id and how many
    of its leading tokens have draft KV. `drafts` (from position `base`) are the proposed tokens
    whose KV was written last step: valid only as far as the request's tokens agree with them."""

    req: Request
    num_computed_tokens: int = 0
    base: int = 0
    drafts: tuple[int, ...] = ()
    block_hashes: tuple = ()  # unused: the draft pool caches nothing
    cache_salt: str = ""

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.req.all_token_ids


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner = runner
        self.kv = kv
        self._seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def load(cls, draft_model: str, target: ModelConfig, num_blocks: int, block_size: int, max_model_len: int,
             dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
             ops: TorchOps | CPUKernelOps) -> "DraftProposer":
        """The draft checkpoint on the model's device, dtype, attention backend and linear/norm
        `ops` (model/ops.py), with a KV pool of `num_blocks`."""
        draft_model = resolve_checkpoint(draft_model, "speculative.draft_model")
        if not (Path(draft_model) / "config.json").is_file():
            raise ValueError(f"speculative.draft_model {draft_model} is not a checkpoint directory (no config.json)")
        mc = ModelConfig.from_dir(draft_model)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative.draft_model {draft_model} has a vocabulary of {mc.vocab_size} tokens and the model "
                f"{target.vocab_size}: a draft model must share the model's vocabulary and tokenizer")
        model = load_model(draft_model, mc, max_model_len, dtype, device)
        model.use_ops(ops)
        kv_cache = torch.zeros(num_blocks, *kv_block_shape(mc, block_size), dtype=dtype, device=device)
        log.info("draft model %s: %d layers, KV pool %d blocks x %d tokens (%.1f MiB)", draft_model,
                 mc.num_layers, num_blocks, block_size, kv_cache.numel() * kv_cache.element_size() / 2**20)
        return cls(ModelRunner(model, kv_cache, backend, block_size, device, seed=0), KVCacheManager(
            num_blocks, block_size, enable_caching=False))

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        return self.propose_batch([(req, k)])[0]

    def propose_batch(self, asks: Sequence[tuple[Request, int]]) -> list[tuple[int, ...]]:
        drafts: list[list[int]] = [[] for _ in asks]
        live: list[tuple[int, _DraftSeq, int]] = []  # (index in asks, seq, k) with draft KV room
        for i, (req, k) in enumerate(asks):
            seq = self._sync(req)
            if k <= 0:
                continue
            # KV for every token the draft has not seen and for d_1 .. d_(k-1)
            if not self.kv.allocate_slots(seq, req.num_tokens + k - 1 - seq.num_computed_tokens):
                # no room: its KV, stale while it cannot draft, goes back for the requests that fit
                self.release(req.request_id)
                continue
            seq.base, seq.drafts = req.num_tokens, ()
            live.append((i, seq, k))
        step = 1
        while live:
            spans = []
            for i, seq, _ in live:
                if step == 1:  # catch up: every token without draft KV
                    spans.append((seq.req, seq.num_computed_tokens, seq.req.all_token_ids[seq.num_computed_tokens:]))
                else:  # the draft token the last forward gave
                    spans.append((seq.req, seq.num_computed_tokens, drafts[i][-1:]))
            tables = {seq.request_id: self.kv.block_ids(seq.request_id) for _, seq, _ in live}
            logits = self.runner.last_logits(spans, tables)
            finite = torch.isfinite(logits.amax(dim=-1))
            tokens = torch.where(finite, logits.argmax(dim=-1), -1).tolist()  # -1: no finite logits (one sync)
            more = []
            for (i, seq, k), (_, _, span_tokens), t in zip(live, spans, tokens):
                seq.num_computed_tokens += len(span_tokens)
                if step > 1:
                    seq.drafts += tuple(span_tokens)
                if t < 0:  # the draft went non-finite: keep what it proposed so far
                    continue
                drafts[i].append(t)
                if step < k:
                    more.append((i, seq, k))
            live = more
            step += 1
        for req, _ in asks:  # a request cut short holds exactly the blocks of its draft KV
            if req.request_id in self._seqs:
                self.kv.trim(req.request_id, self._seqs[req.request_id].num_computed_tokens)
        return [tuple(d) for d in drafts]

    def rollback(self, req: Request) -> None:
        seq = self._seqs.get(req.request_id)
        if seq is not None:
            self._rollback(seq)

    def release(self, request_id: str) -> None:
        if self._seqs.pop(request_id, None) is not None:
            self.kv.free(request_id)

    @property
    def num_requests(self) -> int:
        """Requests with draft state (and maybe blocks) here."""
        return len(self._seqs)

    def num_computed_tokens(self, request_id: str) -> int | None:
        """The request's leading tokens with draft KV (None: no draft state here)."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.num_computed_tokens

    def _sync(self, req: Request) -> _DraftSeq:
        """The request's draft state, valid for its current tokens (a new one when it has none)."""
        seq = self._seqs.get(req.request_id)
        if seq is not None and seq.req is not req:  # a reused id: the old one's KV is meaningless
            self.release(req.request_id)
            seq = None
        if seq is None:
            seq = self._seqs[req.request_id] = _DraftSeq(req)
        self._rollback(seq)
        return seq

    def _rollback(self, seq: _DraftSeq) -> None:
        """Keep the draft KV of the tokens the request has: its tokens before the last drafts and
        the drafts they agree with; always leave the last token to compute (its logits give d_1).
        The blocks past that go back to the draft pool."""
        tokens = seq.req.all_token_ids
        agree = 0
        for d, t in zip(seq.drafts, tokens[seq.base:seq.base + len(seq.drafts)]):
            if d != t:
                break
            agree += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.base + agree, len(tokens) - 1)
        seq.base, seq.drafts = seq.num_computed_tokens, ()
        self.kv.trim(seq.request_id, seq.num_computed_tokens)
