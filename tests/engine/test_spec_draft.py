"""Speculative decoding with a draft model (cluster/engine/spec/draft.py), on tiny random
checkpoints: greedy output equals the engine without speculation token for token, with the model
itself as its draft (every draft accepted) and with an unrelated checkpoint of the same vocabulary
(next to none accepted); the draft's KV pool holds exactly ceil(tokens with draft KV / block_size)
blocks per request after every step and every block comes back when requests finish, abort or
are preempted; a request whose prompt KV and first token came from a prefill engine (a real
in-process handoff: blocks copied between the two engines' pools) or that migrated with tokens
already sent has its draft KV rebuilt here; the layer-skip draft tool keeps the first layers."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cluster.engine.config import SpeculativeOptions
from cluster.engine.kv_cache.manager import cdiv
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.make_draft import make_draft

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
BASE = dict(num_blocks=96, max_num_batched_tokens=64, block_size=16)


def prompts(lengths, seed=0, alphabet=12):
    rng = random.Random(seed)
    return [[256] + [rng.randrange(alphabet) for _ in range(n - 1)] for n in lengths]


def draft_spec(draft_model: str, **kw) -> dict:
    # cost_model off: acceptance alone decides, so the runs are deterministic
    return {"method": "draft", "draft_model": draft_model, "k": 4, "cost_model": "off"} | kw


@pytest.fixture(scope="module")
def other_model(model_factory) -> str:
    """Same vocabulary and tokenizer as tiny_model, nothing else in common (1 layer, hidden 32)."""
    return model_factory("draft-other", layers=1, hidden=32, heads=2, kv_heads=1, vocab=320, max_positions=512,
                         seed=5)


@pytest.fixture(scope="module")
def plain(tiny_model) -> LLMEngine:
    return LLMEngine.from_model(tiny_model, **BASE)


def draft_pool(engine: LLMEngine):
    return engine.speculator.proposer


def assert_draft_blocks_exact(engine: LLMEngine) -> None:
    """Each request with draft state holds exactly the blocks its draft KV needs, and no other
    block of the draft pool is taken."""
    proposer = draft_pool(engine)
    kv = proposer.kv
    kv.check_invariants()
    used = 0
    for rid in kv.holders():
        n = proposer.num_computed_tokens(rid)
        assert n is not None, rid
        req = engine.scheduler.requests[rid]
        assert n <= req.num_tokens - 1  # the last token is always computed again (it gives d_1)
        assert len(kv.block_ids(rid)) == cdiv(n, kv.block_size), rid
        used += len(kv.block_ids(rid))
    assert kv.num_blocks - kv.num_free_blocks == used


def assert_leak_free(engine: LLMEngine) -> None:
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and engine.kv.num_requests() == 0
    proposer = draft_pool(engine)
    proposer.kv.check_invariants()
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert proposer.kv.num_requests() == 0 and proposer.num_requests == 0


def run_stepwise(engine: LLMEngine, check=None) -> dict[str, list[int]]:
    """Step the engine to the end; the tokens per request, `check(engine)` after every step."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
        if check is not None:
            check(engine)
    return tokens


@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_equals_without_speculation(plain, tiny_model, other_model, draft):
    spec = LLMEngine.from_model(
        tiny_model, speculative=draft_spec(tiny_model if draft == "self" else other_model), **BASE)
    ps = prompts([1, 9, 16, 17, 40, 70])
    want = [o.token_ids for o in plain.generate(ps, GREEDY)]
    for i, p in enumerate(ps):
        spec.add_request(f"r{i}", prompt_token_ids=p, sampling=GREEDY)

    def check(engine):
        assert_draft_blocks_exact(engine)
        if draft == "self":  # every draft accepted: the draft KV reaches the last token or the one before
            for rid in draft_pool(engine).kv.holders():
                req = engine.scheduler.requests[rid]
                assert draft_pool(engine).num_computed_tokens(rid) >= req.num_tokens - 2

    got = run_stepwise(spec, check)
    assert [got[f"r{i}"] for i in range(len(ps))] == want
    st = spec.stats
    if draft == "self":
        assert st.spec_proposed_tokens > 100 and st.spec_accepted_tokens >= 0.97 * st.spec_proposed_tokens
        assert st.steps < plain.stats.steps / 2
    else:
        assert st.spec_proposed_tokens > 0 and st.spec_accepted_tokens <= 0.05 * st.spec_proposed_tokens
        assert st.spec_off.get("low_acceptance", 0) >= len(ps)  # every request paused itself
    assert_leak_free(spec)


def test_abort_preemption_and_a_small_draft_pool_leave_no_block_behind(tiny_model):
    # 14 blocks of 4 tokens for four 40-token requests: preemptions are certain; the draft pool
    # (8 blocks) cannot hold every request's draft KV, so some steps go without drafts
    kw = dict(num_blocks=14, block_size=4, max_num_batched_tokens=32)
    plain = LLMEngine.from_model(tiny_model, **kw)
    spec = LLMEngine.from_model(tiny_model, speculative=draft_spec(tiny_model, draft_num_blocks=8), **kw)
    assert draft_pool(spec).kv.num_blocks == 8
    ps = prompts([6, 10, 14, 18], seed=7)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(ps, sp)]
    for i, p in enumerate(ps):
        spec.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
    got = run_stepwise(spec, assert_draft_blocks_exact)
    assert [got[f"r{i}"] for i in range(len(ps))] == want
    assert spec.stats.preemptions > 0 and spec.stats.spec_accepted_tokens > 0
    assert_leak_free(spec)
    # abort each request once it holds draft KV (its drafts were verified, rolled back, kept)
    for victim in (0, 3):
        rids = [f"a{victim}-{i}" for i in range(4)]
        for rid, p in zip(rids, ps):
            spec.add_request(rid, prompt_token_ids=p, sampling=sp)
        aborted = False
        while spec.has_unfinished():
            spec.step()
            if not aborted and draft_pool(spec).kv.block_ids(rids[victim]):  # it holds draft KV now
                assert spec.abort(rids[victim]).finish_reason == "cancelled"
                assert not draft_pool(spec).kv.block_ids(rids[victim])
                aborted = True
            assert_draft_blocks_exact(spec)
        assert aborted
        assert_leak_free(spec)


def test_a_request_handed_off_from_prefill_rebuilds_its_draft_kv(plain, tiny_model):
    """Prefill on one engine (its blocks held after the first token), the KV blocks copied into
    the decode engine's pool (import_request, then activate), as the KV transfer does between
    replicas: the draft has seen none of it and computes prompt + first token in one forward."""
    prefill = LLMEngine.from_model(tiny_model, **BASE)
    decode = LLMEngine.from_model(tiny_model, speculative=draft_spec(tiny_model), **BASE)
    p = prompts([37], seed=11)[0]
    full = plain.generate([p], GREEDY)[0].token_ids
    held = prefill.make_request("h", prompt_token_ids=p, sampling=SamplingParams(max_tokens=1, temperature=0))
    prefill.add(held, hold_kv=True)
    [first] = run_stepwise(prefill)["h"]
    assert first == full[0] and prefill.held("h") is not None
    req = decode.make_request("h", prompt_token_ids=p, sampling=GREEDY)
    reused = decode.import_request(req, prefill.full_block_hashes(held), len(p), first)
    assert reused == 0
    src, dst = prefill.block_ids("h"), decode.block_ids("h")
    decode.kv_cache[dst[:len(src)]] = prefill.kv_cache[src]
    prefill.release("h")
    assert decode.activate("h", len(p), first) is None
    assert draft_pool(decode).num_computed_tokens("h") is None  # nothing of the draft's moved

    rest = []
    for o in decode.step():  # its first decode step: the draft caught up on all 38 tokens
        rest += o.token_ids
    assert draft_pool(decode).num_computed_tokens("h") >= len(p) + 1
    assert decode.stats.spec_accepted_tokens == decode.stats.spec_proposed_tokens == 4
    rest += run_stepwise(decode, assert_draft_blocks_exact)["h"]
    assert [first] + rest == full
    assert_leak_free(decode)
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks


def test_a_migrated_request_rebuilds_its_draft_kv_from_the_tokens_already_sent(plain, tiny_model):
    spec = LLMEngine.from_model(tiny_model, speculative=draft_spec(tiny_model), **BASE)
    p = prompts([25], seed=12)[0]
    full = plain.generate([p], GREEDY)[0].token_ids
    for sent in (1, 9):
        req = spec.make_request(f"migrated-{sent}", prompt_token_ids=p, sampling=GREEDY)
        spec.add_after_tokens(req, full[:sent])
        before = spec.stats.spec_accepted_tokens
        rest = run_stepwise(spec, assert_draft_blocks_exact)[req.request_id]
        assert rest == full[sent:]
        assert spec.stats.spec_accepted_tokens - before >= (40 - sent) // 2
    assert_leak_free(spec)


def test_a_draft_must_share_the_vocabulary(tiny_model, model_factory):
    wide = model_factory("draft-wide", layers=1, hidden=32, heads=2, kv_heads=1, vocab=384, max_positions=512)
    with pytest.raises(ValueError, match="vocabulary of 384 tokens and the model 320"):
        LLMEngine.from_model(tiny_model, speculative=draft_spec(wide), **BASE)
    with pytest.raises(ValueError, match="draft_model is needed"):
        SpeculativeOptions(method="draft")
    with pytest.raises(ValueError, match="draft_model is needed"):
        SpeculativeOptions(method="ngram", draft_model=tiny_model)


def test_make_draft_keeps_the_first_layers(plain, tiny_model, tmp_path):
    out = make_draft(tiny_model, tmp_path / "draft", layers=1)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert (out / "tokenizer.json").read_bytes() == (Path(tiny_model) / "tokenizer.json").read_bytes()
    with safe_open(out / "model.safetensors", framework="pt") as d, \
            safe_open(f"{tiny_model}/model.safetensors", framework="pt") as m:
        assert not any(".layers.1." in n for n in d.keys())
        assert set(d.keys()) == {n for n in m.keys() if ".layers.1." not in n}
        for n in d.keys():
            assert torch.equal(d.get_tensor(n), m.get_tensor(n)), n
    spec = LLMEngine.from_model(tiny_model, speculative=draft_spec(str(out)), **BASE)
    ps = prompts([9, 30], seed=13)
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == [o.token_ids for o in plain.generate(ps, GREEDY)]
    assert spec.stats.spec_proposed_tokens > 0
    assert_leak_free(spec)
