"""Token sampling: logit bias and penalties, greedy, temperature, min-p, top-k, top-p, logprobs,
with a generator per seeded request.

A seeded request draws from its own torch.Generator, so its tokens do not depend on what else
is in the batch: same seed, same tokens.

A step whose requests ask for none of bias, penalties or logprobs (`SamplingParams.plain`) takes
the plain path, untouched by them. Otherwise bias and penalties are applied to the rows that ask,
batched: one index_put_ for every row's bias, one gather of the penalised rows' token counts
(kept per request in one table and updated with the tokens added since the last step), one
where/sub over them. Logprobs are of the raw logits (before any processing), one log_softmax and
one topk over the rows that ask.

A request with a response_format has its grammar's token bitmask applied after bias and
penalties (cluster/engine/grammar.py: the matcher replays the request's output first, so the
state follows it to decode and across a migration); a broken grammar state fails that request.

One request's numbers never fail another: a row whose logits are not finite, or whose
sampling gives no valid distribution, is reported in `SamplerOutput.failed` and the other rows
are sampled as if it were not there. `sample` raises only for what no row explains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.engine.grammar import GrammarFailure, Grammars
from cluster.engine.outputs import TokenLogprob
from cluster.engine.request import Request
from cluster.engine.spec.verify import accept_greedy, accept_sampled
from cluster.errors import ErrorKind


@dataclass(frozen=True)
class RequestFailure:
    """Why one request of a step got no token; the engine ends that request alone."""

    kind: ErrorKind
    reason: str


@dataclass
class SamplerOutput:
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    failed: dict[str, RequestFailure] = field(default_factory=dict)  # request id -> why none
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # request id -> its token's, if asked
    # Speculative chunks (verify): the draft tokens accepted, which come before tokens[request id].
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)


NON_FINITE_LOGITS = RequestFailure(ErrorKind.INTERNAL, "the model's logits are not finite (nan or inf)")
NON_FINITE_PROCESSED = RequestFailure(
    ErrorKind.INVALID_INPUT, "logit_bias and penalties made the logits not finite")

GRAMMAR_EMPTY = RequestFailure(ErrorKind.INTERNAL, "response_format: the grammar allows no token here")


class Sampler:
    def __init__(self, seed: int, grammars: Grammars | None = None):
        self.grammars = grammars  # None: the engine serves no response_format (refused before here)
        self._seed = seed
        self._shared = torch.Generator().manual_seed(seed)
        self._device_gen: torch.Generator | None = None  # created on first use, where the logits are
        self._per_request: dict[str, torch.Generator] = {}
        self._counts = TokenCounts()
        self._bias: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> (ids, biases)

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        self._bias.pop(request_id, None)
        self._counts.release(request_id)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [S, vocab] float32, one row per request -> a token or a failure each."""
        # max propagates nan, so one reduction finds rows with nan, +inf, or nothing finite, and
        # (plain steps) the greedy token too.
        top, top_idx = logits.max(dim=-1)
        finite = torch.isfinite(top)
        raw = logits
        extra = [i for i, r in enumerate(requests) if not r.sampling.plain]
        grammar_failed: dict[int, RequestFailure] = {}
        if not extra:
            greedy = torch.where(finite, top_idx, -1).tolist()  # -1: not finite (one sync)
            if all(r.sampling.greedy for r in requests) and min(greedy, default=0) >= 0:
                # Every row greedy and finite (the common step): its tokens, without the
                # per-request branches below (which give the same for such a step).
                return SamplerOutput(tokens=dict(zip([r.request_id for r in requests], greedy)))
        else:
            logits, processed_ok = self._process(logits, [requests[i] for i in extra], extra)
            logits, grammar_failed = self._constrain(logits, requests)
            # -2: the raw row was finite, this request's own bias or penalties broke it
            greedy = torch.where(finite, torch.where(processed_ok, logits.argmax(dim=-1), -2), -1).tolist()
            for i in grammar_failed:
                greedy[i] = -3  # its grammar state broke (reported below)
        out = SamplerOutput()
        drawn = [i for i, (req, g_tok) in enumerate(zip(requests, greedy)) if g_tok >= 0 and not req.sampling.greedy]
        draws = self._draws(logits, requests, drawn) if drawn else {}
        for i, (req, g_tok) in enumerate(zip(requests, greedy)):
            rid = req.request_id
            if g_tok == -3:
                out.failed[rid] = grammar_failed[i]
            elif g_tok < 0:
                out.failed[rid] = NON_FINITE_LOGITS if g_tok == -1 else NON_FINITE_PROCESSED
            elif req.sampling.greedy:
                out.tokens[rid] = g_tok
            else:
                token = draws[i]
                if isinstance(token, RequestFailure):
                    out.failed[rid] = token
                else:
                    out.tokens[rid] = token
        if extra:
            out.logprobs = _logprobs(raw, [requests[i] for i in extra], extra, out.tokens)
        return out

    def _process(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]):
        """Bias, then penalties, on the rows that ask (`rows[j]` is `reqs[j]`'s). Returns the
        processed logits (a copy when any row changed) and which rows are still finite."""
        biased = [(i, r) for i, r in zip(rows, reqs) if r.sampling.logit_bias]
        penalized = [(i, r) for i, r in zip(rows, reqs) if r.sampling.penalized]
        if not biased and not penalized:  # logprobs only
            return logits, torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        logits = logits.clone()
        dev = logits.device
        if biased:
            parts = [(i, *self._bias_of(r, dev)) for i, r in biased]
            index = torch.cat([torch.full_like(ids, i) for i, ids, _ in parts])
            logits.index_put_((index, torch.cat([ids for _, ids, _ in parts])),
                              torch.cat([b for _, _, b in parts]), accumulate=True)
        if penalized:
            idx = torch.tensor([i for i, _ in penalized], device=dev)
            pen = [r for _, r in penalized]
            counts, in_prompt = self._counts.rows(pen, logits.shape[1], dev)  # [P, V] float32, [P, V] bool
            rep, freq, pres = (_column(pen, name, dev)
                               for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
            x = logits[idx]  # [P, V]
            occurred = counts > 0
            x = torch.where(in_prompt | occurred, torch.where(x > 0, x / rep, x * rep), x)
            logits[idx] = x - freq * counts - pres * occurred.to(x.dtype)
        return logits, torch.isfinite(logits.amax(dim=-1))

    def _constrain(self, logits: torch.Tensor,
                   requests: list[Request]) -> tuple[torch.Tensor, dict[int, RequestFailure]]:
        """The grammar rows' disallowed tokens set to -inf (a new tensor: the raw logits stay), and
        the rows whose grammar state broke. One [S, V] mask for the whole step, rows without a
        grammar all allowed: a gather and scatter of the grammar rows costs more than that."""
        rows = [i for i, r in enumerate(requests) if r.sampling.response_format is not None]
        if not rows:
            return logits, {}
        if self.grammars is None:
            raise RuntimeError("a request with response_format reached an engine without grammars")
        bitmask = torch.full((len(requests), self.grammars.words), -1, dtype=torch.int32)  # CPU: matchers write it
        failed: dict[int, RequestFailure] = {}
        for i in rows:
            req = requests[i]
            try:
                self.grammars.fill(req.request_id, req.sampling.response_format, req.output_token_ids, bitmask[i])
            except GrammarFailure as e:
                failed[i] = RequestFailure(ErrorKind.INTERNAL, str(e))
        for i in (bitmask == 0).all(dim=1).nonzero().flatten().tolist():
            failed.setdefault(i, GRAMMAR_EMPTY)
        refused = _refused(bitmask.to(logits.device, non_blocking=True))[:, :logits.shape[1]]
        return logits.masked_fill(refused, float("-inf")), failed

    def _bias_of(self, req: Request, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._bias.get(req.request_id)
        if cached is None:
            ids, biases = zip(*req.sampling.logit_bias)
            cached = self._bias[req.request_id] = (
                torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(biases, device=device))
        return cached

    def _draws(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> dict[int, int | RequestFailure]:
        """A token (or a failure) for each sampled row. The filtered distributions are computed in
        one batch where the logits are. Rows without a seed draw there too, by an exponential race
        (argmax of p / q, q ~ Exp(1), a draw from p: one kernel and the step's one read of the ids);
        a seeded row draws from its own generator on the host, so its tokens do not depend on the
        batch or the device."""
        dev = logits.device
        sps = [requests[i].sampling for i in rows]
        col = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype)[:, None]  # noqa: E731 — host
        probs = _filtered_probs(
            logits[torch.tensor(rows, device=dev)],
            col([sp.temperature for sp in sps]), col([sp.top_k for sp in sps], torch.long),
            col([sp.top_p for sp in sps]), col([sp.min_p for sp in sps]),
        )
        out: dict[int, int | RequestFailure] = {}
        free = [j for j, sp in enumerate(sps) if sp.seed is None]
        if free:
            p = probs if len(free) == len(rows) else probs[torch.tensor(free, device=dev)]
            race = torch.empty_like(p).exponential_(generator=self._device_generator(dev))
            ok = torch.isfinite(p).all(dim=-1) & (p >= 0).all(dim=-1) & (p.sum(dim=-1) > 0)
            for j, token in zip(free, torch.where(ok, (p / race).argmax(dim=-1), -1).tolist()):
                if token < 0:  # the logits were finite: this request's own sampling numbers broke them
                    token = _sampling_failure(sps[j], probs[j].cpu(), ValueError("no valid distribution"))
                out[rows[j]] = token
        seeded = [j for j, sp in enumerate(sps) if sp.seed is not None]
        if seeded:
            host = probs[torch.tensor(seeded, device=dev)].cpu()
            for k, j in enumerate(seeded):
                out[rows[j]] = self._draw(host[k], requests[rows[j]])
        return out

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """The shared generator of unseeded draws, where the logits are (the host's on a CPU)."""
        if device.type == "cpu":
            return self._shared
        if self._device_gen is None:
            self._device_gen = torch.Generator(device=device).manual_seed(self._seed)
        return self._device_gen

    def verify(self, logits: torch.Tensor, chunks: list[tuple[Request, tuple[int, ...]]]) -> SamplerOutput:
        """Speculative chunks: logits [sum of 1 + len(draft), V], each request's rows contiguous
        (its last token's position, then one per draft). Accepted drafts and the next token per
        request (cluster/engine/spec/verify.py), or a failure when a position it reached has no
        finite logits or its sampling numbers give no distribution. Plain sampling only (the
        speculation controller keeps bias, penalties, logprobs and grammars off this path)."""
        finite = torch.isfinite(logits.amax(dim=-1))
        targets = torch.where(finite, logits.argmax(dim=-1), -1).tolist()  # -1: not finite (one sync)
        out = SamplerOutput()
        cpu_logits = None
        row = 0
        for req, draft in chunks:
            rid, sp, first = req.request_id, req.sampling, row
            row += 1 + len(draft)
            mine = targets[first:row]
            if sp.greedy:
                accepted, token = accept_greedy(mine, draft)  # -1 never equals a draft: it stops there
                if token < 0:
                    out.failed[rid] = NON_FINITE_LOGITS
                else:
                    out.accepted[rid], out.tokens[rid] = accepted, token
                continue
            if cpu_logits is None:
                cpu_logits = logits.cpu()
            probs: list[torch.Tensor] = []

            def position(j: int) -> torch.Tensor:
                if mine[j] < 0:
                    raise _NonFinite
                probs.append(_row_probs(cpu_logits[first + j], sp))
                return probs[-1]

            try:
                out.accepted[rid], out.tokens[rid] = accept_sampled(position, draft, self._generator(req))
            except _NonFinite:
                out.failed[rid] = NON_FINITE_LOGITS
            except Exception as e:  # noqa: BLE001 — this request's failure, never the batch's
                out.failed[rid] = _sampling_failure(sp, probs[-1] if probs else None, e)
        return out

    def _draw(self, probs: torch.Tensor, req: Request) -> int | RequestFailure:
        sp = req.sampling
        try:
            return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())
        except Exception as e:  # noqa: BLE001 — this request's failure, never the batch's
            return _sampling_failure(sp, probs, e)

    def _generator(self, req: Request) -> torch.Generator:
        if req.sampling.seed is None:
            return self._shared
        g = self._per_request.get(req.request_id)
        if g is None:
            g = self._per_request[req.request_id] = torch.Generator().manual_seed(req.sampling.seed)
        return g


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _refused(bitmask: torch.Tensor) -> torch.Tensor:
    """[S, W] int32 bitmask (bit b of word w: token 32w + b allowed) -> [S, 32W] bool, True where
    refused. Read as little-endian bytes, byte k bit j of word w is token 32w + 8k + j: the same order."""
    u8 = bitmask.contiguous().view(torch.uint8)  # [S, 4W]
    return (u8[:, :, None] & _BITS.to(u8.device)).eq(0).view(bitmask.shape[0], -1)


class _NonFinite(Exception):
    """A speculative position the verification reached has no finite logits."""


def _sampling_failure(sp, probs: torch.Tensor | None, e: Exception) -> RequestFailure:
    if probs is not None and not _is_distribution(probs):
        # The logits were finite, so the request's own sampling numbers broke them.
        return RequestFailure(
            ErrorKind.INVALID_INPUT,
            f"sampling parameters (temperature={sp.temperature!r}, top_k={sp.top_k}, top_p={sp.top_p!r}, "
            f"min_p={sp.min_p!r}) "
            f"give no valid probability distribution",
        )
    return RequestFailure(ErrorKind.INTERNAL, f"sampling failed: {type(e).__name__}: {e}")


def _row_probs(row: torch.Tensor, sp) -> torch.Tensor:
    """One row's filtered distribution [V]: the batched filters on a batch of one (the same
    operations as a plain step, so a seeded draw is the same with or without speculation)."""
    col = lambda v, dtype=torch.float32: torch.tensor([[v]], dtype=dtype)  # noqa: E731 — host: no device read
    return _filtered_probs(row[None], col(sp.temperature), col(sp.top_k, torch.long), col(sp.top_p),
                           col(sp.min_p))[0]


def _is_distribution(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all() and (probs >= 0).all() and probs.sum() > 0)


def _column(reqs: list[Request], name: str, device: torch.device) -> torch.Tensor:
    """One sampling parameter of each request, as a [P, 1] column."""
    return torch.tensor([getattr(r.sampling, name) for r in reqs], device=device)[:, None]


def _logprobs(raw: torch.Tensor, reqs: list[Request], rows: list[int],
              tokens: dict[str, int]) -> dict[str, TokenLogprob]:
    """The sampled tokens' raw logprobs and top-k, for the rows that ask: one log_softmax, one
    gather, one topk (the largest k among them) and one sync."""
    asks = [(i, r) for i, r in zip(rows, reqs) if r.sampling.logprobs is not None and r.request_id in tokens]
    if not asks:
        return {}
    dev = raw.device
    lp = torch.log_softmax(raw[torch.tensor([i for i, _ in asks], device=dev)].float(), dim=-1)
    chosen = torch.tensor([tokens[r.request_id] for _, r in asks], device=dev)
    k = min(max(r.sampling.logprobs for _, r in asks), lp.shape[1])
    top_lp, top_ids = lp.topk(k, dim=-1)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0].tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return {r.request_id: TokenLogprob(tokens[r.request_id], chosen_lp[j],
                                       tuple(zip(top_ids[j][:r.sampling.logprobs], top_lp[j][:r.sampling.logprobs])))
            for j, (_, r) in enumerate(asks)}


class TokenCounts:
    """Each penalised request's output-token counts and prompt-token mask, rows of two [slots, V]
    tables: a request gets a slot when first seen, its counts grow by the tokens it gained since
    the last step (one accumulate for the whole batch), and release() frees the slot. Output
    tokens persist through preemption (recompute), so the counts stay right."""

    def __init__(self):
        self.counts: torch.Tensor | None = None  # [slots, V] float32
        self.prompt: torch.Tensor | None = None  # [slots, V] bool: token in the prompt
        self._slot: dict[str, int] = {}
        self._seen: dict[str, int] = {}  # request id -> output tokens already counted
        self._free: list[int] = []

    def rows(self, reqs: list[Request], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        slots, new_slots, new_tokens = [], [], []
        for r in reqs:
            rid = r.request_id
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._admit(r, vocab, device)
            out, seen = r.output_token_ids, self._seen[rid]
            if len(out) > seen:
                new_tokens += out[seen:]
                new_slots += [slot] * (len(out) - seen)
                self._seen[rid] = len(out)
            slots.append(slot)
        if new_tokens:
            self.counts.index_put_(
                (torch.tensor(new_slots, device=device), torch.tensor(new_tokens, device=device)),
                torch.ones(len(new_tokens), device=device), accumulate=True)
        idx = torch.tensor(slots, device=device)
        return self.counts[idx], self.prompt[idx]

    def _admit(self, req: Request, vocab: int, device: torch.device) -> int:
        if not self._free:
            old = 0 if self.counts is None else self.counts.shape[0]
            size = max(8, 2 * old)
            counts = torch.zeros(size, vocab, device=device)
            prompt = torch.zeros(size, vocab, dtype=torch.bool, device=device)
            if old:
                counts[:old], prompt[:old] = self.counts, self.prompt
            self.counts, self.prompt = counts, prompt
            self._free = list(range(size - 1, old - 1, -1))
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        self.prompt[slot, torch.tensor(req.prompt_token_ids, device=device)] = True
        self._slot[req.request_id], self._seen[req.request_id] = slot, 0
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            del self._seen[request_id]
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._slot)


def _filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; each parameter a [R, 1] column (top_k 0: off) -> probs [R, V].

    Row by row the same operations as on one row: a filter a row does not ask for leaves it
    untouched (min_p 0 drops nothing, top_k off compares against -inf, top_p only on rows below 1).
    Which filters run is read from the columns: given on the host (as the sampler gives them),
    that reads nothing back from the device."""
    dev = logits.device
    vocab = logits.shape[-1]
    top_k_host = top_k.cpu()
    k_on_host = (top_k_host > 0) & (top_k_host < vocab)
    p_rows = (top_p.cpu()[:, 0] < 1.0).nonzero().flatten()
    any_min_p = bool((min_p.cpu() > 0).any())
    temperature, top_k, top_p, min_p = (t.to(dev, non_blocking=True) for t in (temperature, top_k, top_p, min_p))
    # Shift before scaling: (x - max) / t <= 0 and the top token's is 0, so no temperature can
    # overflow the row (x / t could: 30 / 1e-38 is inf). Softmax is shift-invariant.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if any_min_p:  # vLLM: drop tokens less likely than min_p x the most likely one
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if bool(k_on_host.any()):
        k_max = int(top_k_host[k_on_host].max())
        k_on = k_on_host.to(dev, non_blocking=True)
        top = torch.topk(logits, k_max, dim=-1).values  # [R, k_max]
        kth = top.gather(1, (top_k.clamp(1, k_max) - 1))
        kth = torch.where(k_on, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p_rows.numel():
        p_rows = p_rows.to(dev, non_blocking=True)
        sub = probs[p_rows]
        sorted_p, idx = sub.sort(dim=-1, descending=True)
        # Keep the smallest head whose mass reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[p_rows]
        sorted_p[drop] = 0.0
        probs[p_rows] = torch.zeros_like(sub).scatter_(1, idx, sorted_p)
    return probs
