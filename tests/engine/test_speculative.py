"""Speculative decoding in the engine (n-gram proposer, tiny random checkpoint): output equals the
engine without speculation token for token (greedy, and seeded sampling), stops and max_tokens
behave the same, sampled tokens keep the target distribution, requests it cannot serve exactly do
not speculate, and every lifecycle (abort mid-speculation, preemption) ends leak-free."""

import random

import pytest
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampler import _row_probs
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.spec.proposer import Proposer
from tests.engine.test_spec_units import CHI2_999, chi_square
from tests.reference import hf_greedy, hf_last_logits

NGRAM = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3, "cost_model": "off"}  # acceptance alone decides: deterministic
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts(lengths, seed=0, alphabet=12):
    """Prompts over a small alphabet, so n-grams recur and drafts get accepted."""
    rng = random.Random(seed)
    return [[256] + [rng.randrange(alphabet) for _ in range(n - 1)] for n in lengths]


def assert_leak_free(engine: LLMEngine):
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.num_requests() == 0


def pair(model, **kw):
    base = dict(num_blocks=96, max_num_batched_tokens=32, block_size=16) | kw
    return LLMEngine.from_model(model, **base), LLMEngine.from_model(model, speculative=NGRAM, **base)


@pytest.fixture(scope="module")
def engines(tiny_model):
    return pair(tiny_model)


def test_greedy_equals_without_speculation_and_transformers(engines, tiny_model):
    plain, spec = engines
    ps = prompts([1, 9, 16, 17, 40, 70])
    want = plain.generate(ps, GREEDY)
    before = spec.stats.spec_accepted_tokens
    got = spec.generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got[:3]] == [hf_greedy(tiny_model, p, 40) for p in ps[:3]]
    assert all(o.finish_reason == "length" and o.num_output_tokens == 40 for o in got)
    assert spec.stats.spec_accepted_tokens - before >= 40  # it did speculate, and drafts were accepted
    assert spec.stats.steps < plain.stats.steps
    assert_leak_free(spec)


def test_seeded_sampling_equals_without_speculation(engines):
    """Verification draws one token per position from the request's own generator, as decoding
    does: same seed, same tokens, with or without drafts (top_p and min_p included). The random
    checkpoint's logits are nearly flat: low temperatures make its samples repeat enough to copy."""
    plain, spec = engines
    ps = prompts([12, 30, 50], seed=3)
    sps = [SamplingParams(max_tokens=40, temperature=t, top_p=tp, min_p=mp, seed=s, ignore_eos=True)
           for t, tp, mp, s in ((0.01, 1.0, 0.0, 1), (0.02, 0.9, 0.0, 2), (0.015, 1.0, 0.05, 3))]
    before = spec.stats.spec_accepted_tokens
    got, want = spec.generate(ps, sps), plain.generate(ps, sps)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.stats.spec_accepted_tokens - before >= 10
    assert_leak_free(spec)


def test_stop_strings_and_max_tokens_as_without_speculation(engines):
    plain, spec = engines
    p = prompts([20], seed=5)[0]
    full = plain.generate([p], GREEDY)[0]
    assert len(full.text) > 30
    for start in (3, 11, 19, 27):  # stops that end inside a speculative step's tokens, and between
        stop = full.text[start:start + 3]
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
        want, got = plain.generate([p], sp)[0], spec.generate([p], sp)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.num_output_tokens) == (
            want.token_ids, want.text, want.finish_reason, want.num_output_tokens), stop
        assert want.finish_reason == "stop"
    for n in (1, 2, 3, 5, 8, 13):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        got = spec.generate([p], sp)[0]
        assert got.token_ids == full.token_ids[:n] and got.num_output_tokens == n and got.finish_reason == "length"
    assert_leak_free(spec)


def test_abort_mid_speculation_and_preemption_leave_no_block_behind(tiny_model):
    # 14 blocks of 4 tokens for four 40-token requests: preemptions are certain
    plain, spec = pair(tiny_model, num_blocks=14, block_size=4)
    ps = prompts([6, 10, 14, 18], seed=7)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = plain.generate(ps, sp)
    got = spec.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.stats.preemptions > 0 and spec.stats.spec_accepted_tokens > 0
    assert_leak_free(spec)
    # abort each request in the step right after it was given drafts (its chunk is in flight)
    for victim in (0, 3):
        rids = [f"a{victim}-{i}" for i in range(4)]
        for rid, p in zip(rids, ps):
            spec.add_request(rid, prompt_token_ids=p, sampling=sp)
        aborted = False
        while spec.has_unfinished():
            target = spec.scheduler.requests.get(rids[victim])
            spec.step()
            if not aborted and target is not None and target.spec is not None and target.spec.verified_steps:
                assert spec.abort(rids[victim]).finish_reason == "cancelled"
                aborted = True
            spec.check_invariants()
        assert aborted
        assert_leak_free(spec)


def test_requests_it_cannot_serve_exactly_do_not_speculate(engines):
    plain, spec = engines
    p = prompts([30], seed=9)[0]
    cases = {
        "penalties": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        "logit_bias": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias={5: 3.0}),
        "logprobs": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
    }
    for reason, sp in cases.items():
        off, steps = spec.stats.spec_off.get(reason, 0), spec.stats.spec_steps
        got, want = spec.generate([p], sp)[0], plain.generate([p], sp)[0]
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
        assert spec.stats.spec_off[reason] == off + 1 and spec.stats.spec_steps == steps, reason
    assert_leak_free(spec)


def test_a_large_decode_batch_turns_speculation_off(tiny_model):
    spec = LLMEngine.from_model(tiny_model, num_blocks=96, speculative=NGRAM | {"max_batch": 2})
    ps = prompts([10, 11, 12], seed=4)
    spec.generate(ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert spec.stats.spec_steps == 0 and spec.stats.spec_off["batch"] == 9  # 3 decoding, tokens 2..10
    assert_leak_free(spec)


def test_low_acceptance_pauses_a_request(tiny_model):
    """Hot sampling over 320 tokens: 1-gram drafts are nearly always rejected, so the request
    stops speculating after 3 verified steps and tries again after 16, 32, ... tokens."""
    spec = LLMEngine.from_model(tiny_model, num_blocks=96, speculative=NGRAM)
    sp = SamplingParams(max_tokens=200, temperature=1.5, seed=0, ignore_eos=True)
    spec.generate([prompts([8], alphabet=256)[0]], sp)
    st = spec.stats
    assert st.spec_off.get("low_acceptance", 0) >= 2
    assert st.spec_steps <= 3 + 2 * (st.spec_off["low_acceptance"]) + 10  # a few steps per pause
    assert st.spec_accepted_tokens / st.spec_proposed_tokens < 0.35
    assert_leak_free(spec)


class TableProposer(Proposer):
    """Drafts table[last token]: any Proposer will do for verification, so the test picks drafts
    that the target accepts sometimes, not always."""

    def __init__(self, table: dict[int, int]):
        self.table = table

    def propose(self, req, k):
        return (self.table[req.all_token_ids[-1]],)


@pytest.mark.parametrize("proposer", ["table", "draft"])
def test_sampled_tokens_keep_the_target_distribution(tiny_model, proposer):
    """2,000 unseeded requests (the engine's shared generator, seed fixed), top_k 4 so each
    position has 4 outcomes. The second output token comes from verifying a draft: after first
    token y1, "table": the second most likely token given y1; "draft": the draft model's argmax
    (the model itself as its draft: a point mass on the most likely token). Its counts follow
    the model's marginal sum_y1 p(y1) p(y2 | y1) (chi-square below the 0.1% point)."""
    method = NGRAM if proposer == "table" else {"method": "draft", "draft_model": tiny_model, "k": 4,
                                                  "cost_model": "off"}
    spec = LLMEngine.from_model(tiny_model, num_blocks=256, max_num_seqs=64, max_num_batched_tokens=1024,
                                speculative=method | {"max_batch": 64})
    prompt = [256, 3, 4, 5, 3, 4, 5, 3, 4]
    FILTER = SamplingParams(temperature=1.0, top_k=4)  # noqa: N806
    p1 = _row_probs(hf_last_logits(tiny_model, prompt), FILTER)
    marginal, table = torch.zeros_like(p1), {}
    for y1 in p1.nonzero().flatten().tolist():
        p2 = _row_probs(hf_last_logits(tiny_model, prompt + [y1]), FILTER)
        marginal += p1[y1] * p2
        table[y1] = int(p2.argsort(descending=True)[1])
    if proposer == "table":
        spec.speculator.proposer = TableProposer(table)
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)  # room for one draft
    n = 2000
    outs = spec.generate([prompt] * n, sp)
    assert spec.stats.spec_steps >= n  # every second token came from verifying a draft
    support = marginal.nonzero().flatten()
    counts = torch.zeros_like(marginal)
    for o in outs:
        counts[o.token_ids[1]] += 1
    assert counts.sum() == counts[support].sum()  # nothing outside the target's support
    df = len(support) - 1
    assert chi_square(counts[support], marginal[support]) < CHI2_999[df], (df, counts[support], marginal[support] * n)
    assert 0.1 * n < spec.stats.spec_accepted_tokens < 0.9 * n  # drafts both accepted and rejected
    assert_leak_free(spec)
    if proposer == "draft":
        draft_kv = spec.speculator.proposer.kv
        assert draft_kv.num_free_blocks == draft_kv.num_blocks and draft_kv.num_requests() == 0


def test_a_migrated_request_speculates_from_the_tokens_already_sent(engines, tiny_model):
    """add_after_tokens (a migration, or decode computing a prompt whose first token came from
    prefill): the prompt and the tokens already sent are computed here, then it speculates."""
    plain, spec = engines
    p = prompts([25], seed=11)[0]
    full = plain.generate([p], GREEDY)[0].token_ids
    for sent in (1, 9):
        before = spec.stats.spec_accepted_tokens
        req = spec.make_request(f"migrated-{sent}", prompt_token_ids=p, sampling=GREEDY)
        spec.add_after_tokens(req, full[:sent])
        rest = []
        while spec.has_unfinished():
            for o in spec.step():
                rest += o.token_ids
        assert rest == full[sent:]
        assert spec.stats.spec_accepted_tokens > before
    assert_leak_free(spec)
