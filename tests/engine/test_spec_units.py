"""Speculative decoding's parts without a model: the n-gram proposer's drafts, the scheduler's
block accounting when drafts are rejected (exact block ids and free counts), and the acceptance
functions' output distribution (chi-square against the target, fixed seeds)."""

import pytest
import torch

from cluster.engine.config import SpeculativeOptions
from cluster.engine.kv_cache import KVCacheManager
from cluster.engine.outputs import EngineStats
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec.controller import Speculator
from cluster.engine.spec.cost import PROBE_EVERY, StepCosts, draft_probabilities
from cluster.engine.spec.proposer import NgramProposer, Proposer
from cluster.engine.spec.state import SpecState
from cluster.engine.spec.verify import accept_greedy, accept_rejection, accept_sampled

# Upper 0.1% points of the chi-square distribution (a fair test fails once in a thousand runs;
# the seeds are fixed, so each run is the same run).
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588,
            11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def spec_request(tokens, rid="r"):
    r = Request(rid, list(tokens), SamplingParams(max_tokens=64, temperature=0))
    r.spec = SpecState(k=4)
    return r


def test_ngram_proposes_what_followed_the_first_earlier_occurrence_longest_n_first():
    p = NgramProposer(ngram_min=1, ngram_max=3)
    r = spec_request([5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7])
    assert p.propose(r, 4) == (8, 9, 1, 6)  # (5, 6, 7) at 0..2: what followed it
    r.append_token(3)
    assert p.propose(r, 4) == ()  # 3 never occurred before
    r.append_token(9)
    assert p.propose(r, 2) == (1, 6)  # (3, 9), (9) ... only (9,) matches, at 4
    assert p.propose(r, 9) == (1, 6, 7, 2, 5, 6, 7, 3, 9)  # up to the end of the known tokens


def test_ngram_below_its_minimum_proposes_nothing():
    p = NgramProposer(ngram_min=2, ngram_max=2)
    assert p.propose(spec_request([1, 2, 3, 1]), 4) == ()
    assert p.propose(spec_request([1, 2, 3, 1, 2]), 4) == (3, 1, 2)


def test_rejected_drafts_give_their_blocks_back_exactly():
    kv = KVCacheManager(16, block_size=4)
    s = Scheduler(kv, 8, 32, 1024)
    r = Request("r", list(range(7)), SamplingParams(max_tokens=20, temperature=0))
    s.add(r)
    out = s.schedule()
    s.update(out, {"r": 100})  # prompt of 7 + first token: 8 tokens, 7 computed, 2 blocks
    assert kv.block_ids("r") == [0, 1] and kv.num_free_blocks == 14
    r.draft_token_ids = (101, 102, 103, 104, 105, 106)  # positions 8..13: blocks 2 and 3 too
    out = s.schedule()
    [c] = out.chunks
    assert (c.start, c.num_tokens, c.draft) == (7, 7, (101, 102, 103, 104, 105, 106))
    assert kv.block_ids("r") == [0, 1, 2, 3] and kv.num_free_blocks == 12
    s.update(out, {"r": 7}, {"r": (101,)})  # one accepted, then 7 instead of 102
    assert r.output_token_ids == [100, 101, 7] and r.num_computed_tokens == 9 and r.num_tokens == 10
    # a decode would hold ceil(9 / 4) = 3 blocks now; block 3 (never cached) is first to reuse
    assert kv.block_ids("r") == [0, 1, 2] and kv.num_free_blocks == 13
    assert kv.pool.free_block_ids()[0] == 3
    s.check_invariants()
    r.draft_token_ids = (1, 2)
    out = s.schedule()
    s.finish("r", RequestStatus.FINISHED_ABORTED)  # aborted while its speculative step runs
    assert s.update(out, {"r": 5}, {"r": (1, 2)}) == []
    s.check_invariants()
    assert kv.num_free_blocks == 16 and kv.num_requests() == 0


def test_a_stop_among_accepted_drafts_ends_the_request_there():
    kv = KVCacheManager(16, block_size=4)
    s = Scheduler(kv, 8, 32, 1024)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), eos_token_ids=(9,))
    s.add(r)
    s.update(s.schedule(), {"r": 4})
    r.draft_token_ids = (5, 6, 7)
    out = s.schedule()
    # the scheduler takes the drafts it is given (the controller caps them by max_tokens);
    # update enforces max_tokens all the same
    assert [c.num_tokens for c in out.chunks] == [4]
    assert s.update(out, {"r": 8}, {"r": (5, 6)}) == [r]
    assert r.output_token_ids == [4, 5, 6, 8] and r.status == RequestStatus.FINISHED_LENGTH
    r2 = Request("r2", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0), eos_token_ids=(9,))
    s.add(r2)
    s.update(s.schedule(), {"r2": 4})
    r2.draft_token_ids = (9, 6)
    out = s.schedule()
    assert s.update(out, {"r2": 0}, {"r2": (9, 6)}) == [r2]
    assert r2.output_token_ids == [4, 9] and r2.status == RequestStatus.FINISHED_STOPPED  # nothing after EOS
    s.check_invariants()
    assert kv.num_free_blocks == 16


def test_drafts_take_only_budget_the_other_decodes_do_not_need_and_never_preempt():
    kv = KVCacheManager(4, block_size=4)
    s = Scheduler(kv, 8, 4, 1024)
    a, b = (Request(x, [1], SamplingParams(max_tokens=20, temperature=0)) for x in "ab")
    s.add(a), s.add(b)
    s.update(s.schedule(), {"a": 4, "b": 4})
    a.draft_token_ids = (5, 6, 7, 8)
    out = s.schedule()  # budget 4: b needs 1, so a gets 2 drafts
    assert [(c.request.request_id, c.num_tokens, c.draft) for c in out.chunks] == [("a", 3, (5, 6)), ("b", 1, ())]
    s.update(out, {"a": 0, "b": 0}, {"a": ()})
    assert kv.block_ids("a") == [0] and kv.num_free_blocks == 2  # 4 tokens: still its one block
    assert kv.allocate_slots(Request("x", [0] * 8, SamplingParams()), 8)  # the last 2 blocks taken
    a.draft_token_ids = (5, 6, 7, 8)
    out = s.schedule()  # no room for the drafts: a decodes without them, nobody is preempted
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    assert out.preempted == [] and a.draft_token_ids == ()


def test_greedy_acceptance_is_the_longest_matching_prefix_then_the_target():
    assert accept_greedy([5, 6, 7, 8], (5, 6, 9)) == ((5, 6), 7)
    assert accept_greedy([5, 6, 7, 8], (5, 6, 7)) == ((5, 6, 7), 8)  # all accepted: the bonus token
    assert accept_greedy([4, 6], (5,)) == ((), 4)


P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
P1 = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.20, 0.20])


@pytest.mark.parametrize("draft_token", [1, 0, 3])
def test_sampled_acceptance_keeps_the_target_distribution(draft_token):
    """20,000 draws, draft x with p(x) in {0.30, 0.05, 0.25}: the first emitted token ~ P0, the
    acceptance rate is p(x), and after an accepted draft the next token ~ P1 (chi-square at the
    0.1% point; acceptance within 4 standard deviations)."""
    g = torch.Generator().manual_seed(1234)
    n = 20000
    first, second, accepted = torch.zeros(6), torch.zeros(6), 0
    for _ in range(n):
        acc, tok = accept_sampled(lambda j: (P0, P1)[j], (draft_token,), g)
        emitted = (*acc, tok)
        first[emitted[0]] += 1
        if acc:
            accepted += 1
            second[emitted[1]] += 1
    assert chi_square(first, P0) < CHI2_999[5]
    assert chi_square(second, P1) < CHI2_999[5]
    p = float(P0[draft_token])
    assert abs(accepted / n - p) < 4 * (p * (1 - p) / n) ** 0.5


def test_the_textbook_rejection_sampler_agrees():
    """Accept x with p(x), else sample p without x renormalised: the same distribution."""
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(6)
    for _ in range(10000):
        counts[accept_rejection(P0, 1, g)[1]] += 1
    assert chi_square(counts, P0) < CHI2_999[5]


# ---- the adaptive switch's cost model (cluster/engine/spec/cost.py) ------------------------------

def test_step_costs_price_a_row_count_measured_interpolated_or_extrapolated():
    c = StepCosts()
    assert c.seconds(8, 8) is None
    c.observe(8, 8, 0.050)
    assert c.seconds(8, 8) == 0.050 and c.seconds(8, 16) is None  # one row count: nothing to draw a line with
    c.observe(8, 40, 0.130)
    assert c.seconds(8, 24) == pytest.approx(0.090)  # halfway between 8 and 40 rows
    assert c.seconds(8, 48) == pytest.approx(0.150)  # past the largest: along the last segment
    c.observe(8, 40, 0.180)  # EWMA 0.2
    assert c.table(8) == pytest.approx({8: 0.050, 40: 0.8 * 0.130 + 0.2 * 0.180})
    c.observe(2, 2, 0.050)
    c.observe(2, 4, 0.040)  # a faster step with drafts (noise): extrapolation never falls
    assert c.seconds(2, 6) == pytest.approx(0.040) and c.seconds(2, 3) == pytest.approx(0.045)
    assert c.table(4) == {}


def test_plan_explores_the_far_end_then_the_plain_step():
    c = StepCosts()
    assert c.plan(8, []) == 0
    assert c.plan(8, [0.9] * 32) == 32  # nothing measured: every draft (measures the far end)
    c.observe(8, 40, 0.130)
    assert c.plan(8, [0.9] * 32) == 0  # the far end but no plain step: none
    c.observe(8, 8, 0.050)
    assert c.plan(8, [0.1] * 32) == 0  # both ends measured: priced (3.2 tokens for 80 ms more do not pay)
    c2 = StepCosts()
    c2.observe(1, 1, 0.020)
    assert c2.plan(1, [0.5, 0.25]) == 2  # only the plain step measured: the far end next


def jumped() -> StepCosts:
    """Batch 8: a plain step 50 ms; the first draft leaves the small-row kernel (+30 ms); then
    1.6 ms a row up to 40 rows."""
    c = StepCosts()
    c.observe(8, 8, 0.050)
    c.observe(8, 9, 0.080)
    c.observe(8, 40, 0.080 + 31 * 0.0016)
    return c


def test_plan_pays_the_jump_once_when_most_drafts_are_accepted():
    # 32 drafts at 0.95: 38.4 tokens in 130 ms beats 8 in 50 ms, though 1 draft alone would not pay
    assert jumped().plan(8, [0.95] * 32) == 32
    assert jumped().plan(8, [0.95]) == 0  # 8.95 tokens in 80 ms < 8 in 50 ms
    assert jumped().plan(8, [0.2] * 32) == 0  # 14.4 tokens in 130 ms < 8 in 50 ms


def test_plan_takes_the_best_drafts_when_only_some_pay():
    c = StepCosts()
    c.observe(8, 8, 0.050)
    c.observe(8, 12, 0.055)
    c.observe(8, 40, 0.200)
    # 4 likely drafts: 11.8 tokens in 55 ms (214/s) beats plain (160/s), all 32 (73/s), or 5 (197/s)
    assert c.plan(8, [0.95] * 4 + [0.1] * 28) == 4


def test_every_probe_every_plans_the_end_not_being_chosen_is_measured_again():
    c = jumped()
    choices = [c.plan(8, [0.95] * 32) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, n in enumerate(choices) if n != 32] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    c = jumped()
    choices = [c.plan(8, [0.2] * 32) for _ in range(PROBE_EVERY)]
    assert [i for i, n in enumerate(choices) if n != 0] == [PROBE_EVERY - 1]


def test_draft_probabilities_rank_every_candidate_draft():
    ranked = draft_probabilities([0.5, 0.9], [2, 3])
    assert [i for _, i in ranked] == [1, 1, 1, 0, 0]
    assert [p for p, _ in ranked] == pytest.approx([0.9, 0.81, 0.729, 0.5, 0.25])
    assert draft_probabilities([1.0, 0.0], [2, 1]) == [(1.0, 0), (1.0, 0), (0.0, 1)]


class FixedProposer(Proposer):
    def propose(self, req, k):
        return (7,) * k


def decoding_request(rid: str, acceptance: float, k: int) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=64, temperature=0))
    r.append_token(5)
    r.num_computed_tokens = 3  # the first output token is the one to decode next
    r.spec = SpecState(k=k, acceptance=acceptance, verified_steps=3)
    return r


def speculator(**options) -> Speculator:
    return Speculator(SpeculativeOptions(method="ngram", **options), FixedProposer(), EngineStats(), 2048)


@pytest.mark.parametrize("acceptance, drafts", [(0.95, 4), (0.2, 0)])
def test_a_batch_drafts_when_its_drafts_pay_for_the_step_they_make(acceptance, drafts):
    s = speculator()
    s.costs = jumped()
    reqs = [decoding_request(f"r{i}", acceptance, 4) for i in range(8)]
    s.propose(reqs)
    assert [len(r.draft_token_ids) for r in reqs] == [drafts] * 8
    assert s.stats.spec_off == ({} if drafts else {"cost": 1})  # one count per step that held any back


def test_a_request_gets_the_drafts_that_pay_and_cost_model_off_ignores_costs():
    s = speculator()
    s.costs.observe(2, 2, 0.050)
    s.costs.observe(2, 6, 0.060)
    s.costs.observe(2, 10, 0.200)
    good, bad = decoding_request("good", 0.95, 4), decoding_request("bad", 0.3, 4)
    s.propose([good, bad])  # good's 4 drafts: 5.5 tokens in 60 ms; a fifth (bad's 0.3) costs 35 ms
    assert (good.draft_token_ids, bad.draft_token_ids, s.stats.spec_off) == ((7, 7, 7, 7), (), {"cost": 1})
    one = speculator()
    one.costs.observe(1, 1, 0.020)
    one.costs.observe(1, 3, 0.022)
    one.costs.observe(1, 5, 0.050)
    r = decoding_request("r", 0.9, 4)
    one.propose([r])  # 2 drafts: 2.71 tokens in 22 ms; 3: 3.44 in 36 ms; 4: 4.06 in 50 ms
    assert r.draft_token_ids == (7, 7) and one.stats.spec_off == {}
    off = speculator(cost_model="off")
    off.costs = s.costs
    bad = decoding_request("bad", 0.3, 4)
    off.propose([bad])
    assert bad.draft_token_ids == (7, 7, 7, 7) and off.stats.spec_off == {}


def test_a_new_request_is_priced_at_the_replicas_recent_acceptance():
    """Where drafts are mostly rejected, a request not verified yet counts at the replica's recent
    rate, not its own optimistic start, so new requests do not each pay a verify step to find out."""
    fresh = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, temperature=0)) for i in range(8)]
    for r in fresh:
        r.append_token(5)
        r.num_computed_tokens = 3
    s = speculator()
    s.costs = jumped()
    s.propose(fresh)  # prior 0.8 (the start): 8 + 18.9 expected tokens in 130 ms beat 8 in 50 ms
    assert [len(r.draft_token_ids) for r in fresh] == [4] * 8 and all(r.spec.verified_steps == 0 for r in fresh)
    s.prior_acceptance = 0.2
    for r in fresh:
        r.draft_token_ids = ()
    s.propose(fresh)
    assert [len(r.draft_token_ids) for r in fresh] == [0] * 8 and s.stats.spec_off == {"cost": 1}
    s.costs = StepCosts()  # 4 drafts cheap, more dear: 8 + 3.5 tokens in 55 ms beat 8 in 50 ms
    for rows, seconds in ((8, 0.050), (12, 0.055), (40, 0.200)):
        s.costs.observe(8, rows, seconds)
    verified = decoding_request("v", 0.95, 4)  # its own rate, once verified
    s.propose([verified] + fresh[:7])
    assert len(verified.draft_token_ids) == 4 and [len(r.draft_token_ids) for r in fresh[:7]] == [0] * 7
