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
from cluster.engine.spec.cost import PROBE_EVERY, StepCosts, expected_accepted
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

def test_step_costs_give_the_min_gain_from_measured_step_times():
    c = StepCosts()
    assert c.min_gain(8) is None  # nothing measured: drafts go ahead (that is how c(b) is measured)
    c.observe(8, 2, 0.5)  # a drafted step before any plain one at this batch: no c(8) sample
    assert c.estimate(8) == (None, None) and c.min_gain(8) is None
    c.observe(8, 0, 0.100)
    assert c.min_gain(8) is None  # T(8) known, c(8) not yet
    c.observe(8, 2, 0.140)  # 2 drafted requests cost 40 ms more: 20 ms each
    assert c.estimate(8) == pytest.approx((0.100, 0.020))
    assert c.min_gain(8) == pytest.approx(8 * 0.020 / 0.100)  # 1.6 accepted drafts per drafted request
    c.observe(8, 0, 0.150)  # EWMA 0.2: T = 0.8 * 0.100 + 0.2 * 0.150
    assert c.estimate(8) == pytest.approx((0.110, 0.020))
    c.observe(1, 0, 0.050)
    c.observe(1, 1, 0.060)
    assert c.min_gain(1) == pytest.approx(0.2)  # the same extra cost is cheap at batch 1
    c.observe(1, 1, 0.040)  # a drafted step faster than a plain one (noise): c goes down, min_gain >= 0
    assert c.estimate(1)[1] == pytest.approx(0.8 * 0.010 + 0.2 * -0.010)
    for _ in range(PROBE_EVERY - 1):
        c.held_back(8)
    assert c.min_gain(8) == pytest.approx(8 * 0.020 / 0.110)
    c.held_back(8)  # the 64th held step: the next step drafts anyway, then holding starts over
    assert c.min_gain(8) is None
    c.probed(8)
    assert c.min_gain(8) == pytest.approx(8 * 0.020 / 0.110)


def test_expected_accepted_drafts():
    assert expected_accepted(0.5, 1) == 0.5
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.8, 4) == pytest.approx(0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.0, 4) == 0


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


@pytest.mark.parametrize("batch, acceptance, k, drafts", [
    (8, 0.8, 4, 4),  # expects 2.36 accepted > min_gain(8) 1.6: drafts
    (8, 0.6, 2, 0),  # 0.96 <= 1.6: held back
    (8, 0.9, 1, 0),  # 0.9: one draft cannot pay at batch 8 even when it is nearly always accepted
    (1, 0.3, 1, 1),  # 0.3 > min_gain(1) 0.2: drafts at batch 1
    (1, 0.15, 1, 0),  # 0.15 < 0.2: held back
    (4, 0.1, 1, 1),  # batch 4 not measured: drafts go ahead
])
def test_a_request_drafts_only_when_its_expected_accepted_drafts_pay_at_the_batch(batch, acceptance, k, drafts):
    s = speculator()
    s.costs.observe(8, 0, 0.100)
    s.costs.observe(8, 2, 0.140)  # min_gain(8) = 1.6
    s.costs.observe(1, 0, 0.050)
    s.costs.observe(1, 1, 0.060)  # min_gain(1) = 0.2
    reqs = [decoding_request(f"r{i}", acceptance, k) for i in range(batch)]
    s.propose(reqs)
    assert [len(r.draft_token_ids) for r in reqs] == [drafts] * batch
    assert s.stats.spec_off == ({} if drafts else {"cost": 1})  # one count per step that held any back


def test_held_back_requests_mix_with_drafting_ones_and_cost_model_off_ignores_costs():
    s = speculator()
    s.costs.observe(2, 0, 0.100)
    s.costs.observe(2, 1, 0.150)  # min_gain(2) = 2 * 0.05 / 0.1 = 1.0
    good, bad = decoding_request("good", 0.8, 4), decoding_request("bad", 0.5, 4)  # 2.36 and 0.94
    s.propose([good, bad])
    assert (good.draft_token_ids, bad.draft_token_ids, s.stats.spec_off) == ((7, 7, 7, 7), (), {"cost": 1})
    off = speculator(cost_model="off")
    off.costs.observe(2, 0, 0.100)
    off.costs.observe(2, 1, 0.150)
    bad = decoding_request("bad", 0.5, 4)
    off.propose([bad])
    assert bad.draft_token_ids == (7, 7, 7, 7) and off.stats.spec_off == {}


def test_after_probe_every_held_steps_one_step_drafts_then_holding_resumes():
    s = speculator()
    s.costs.observe(1, 0, 0.050)
    s.costs.observe(1, 1, 0.100)  # min_gain(1) = 1.0
    drafted = []
    for step in range(2 * PROBE_EVERY + 2):
        r = decoding_request("r", 0.5, 2)  # expects 0.75 < 1.0
        s.propose([r])
        if r.draft_token_ids:
            drafted.append(step)
    assert drafted == [PROBE_EVERY, 2 * PROBE_EVERY + 1]
    assert s.stats.spec_off == {"cost": 2 * PROBE_EVERY}
