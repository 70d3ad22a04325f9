"""The engine equals transformers token for token (float32, greedy), under every scheduling path."""

import random

import pytest
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.reference import hf_greedy, hf_last_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n, lengths, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[256] + [rng.randrange(vocab) for _ in range(length - 1)] for length in lengths[:n]]


def assert_leak_free(engine: LLMEngine):
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.num_requests() == 0


@pytest.fixture(scope="module")
def engine(tiny_model):
    # A small token budget forces chunked prefill for every prompt longer than 24 tokens.
    return LLMEngine.from_model(tiny_model, num_blocks=96, max_num_batched_tokens=24, block_size=16)


def test_concurrent_mixed_lengths_equal_transformers(engine, tiny_model):
    # 1 token, under a block, exactly a block, crossing boundaries, several chunks long.
    ps = prompts(8, [1, 5, 15, 16, 17, 33, 64, 100], seed=1)
    outs = engine.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(tiny_model, p, 12), f"prompt of {len(p)} tokens"
        assert o.finish_reason == "length" and o.num_output_tokens == 12
    assert_leak_free(engine)


def test_prefix_cache_hit_gives_the_same_tokens(engine, tiny_model):
    engine.kv.pool.reset_cache()
    base = prompts(1, [70], seed=2)[0]
    first = engine.generate([base], GREEDY)[0]
    assert first.num_cached_tokens == 0
    follow = base[:50] + [7, 8, 9, 10, 11]  # shares 3 full blocks (48 tokens)
    out = engine.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == 48
    assert out.token_ids == hf_greedy(tiny_model, follow, 12)
    again = engine.generate([base], GREEDY)[0]
    assert again.num_cached_tokens == 64  # 4 full blocks; the 70th token is recomputed
    assert again.token_ids == first.token_ids
    assert_leak_free(engine)


def test_last_position_logits_within_1e4_of_transformers(engine, tiny_model):
    captured = {}
    sample = engine.runner.sampler.sample

    def spy(logits, requests):
        for row, r in zip(logits, requests):
            captured.setdefault(r.request_id, []).append(row.clone())
        return sample(logits, requests)

    engine.runner.sampler.sample = spy
    try:
        ps = prompts(3, [9, 40, 77], seed=3)
        outs = engine.generate(ps, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        engine.runner.sampler.sample = sample
    for p, o, rid in zip(ps, outs, sorted(captured)):
        rows = captured[rid]
        seq = p + o.token_ids
        for k, row in enumerate(rows):  # prefill's last position, then each decode step
            ref = hf_last_logits(tiny_model, seq[: len(p) + k])
            assert torch.allclose(row, ref, atol=1e-4, rtol=0), (len(p), k, (row - ref).abs().max())
    assert_leak_free(engine)


def test_output_after_preemption_equals_output_without(tiny_model):
    ps = prompts(6, [30, 45, 20, 60, 35, 50], seed=4)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLMEngine.from_model(tiny_model, num_blocks=64, max_num_batched_tokens=64)
    expected = [o.token_ids for o in roomy.generate(ps, sp)]
    tight = LLMEngine.from_model(tiny_model, num_blocks=12, max_num_batched_tokens=64)
    got = [o.token_ids for o in tight.generate(ps, sp)]
    assert tight.stats.preemptions > 0
    assert got == expected
    assert_leak_free(tight)
    assert_leak_free(roomy)


def test_same_seed_same_tokens_whatever_the_batch(engine):
    p = prompts(1, [20], seed=5)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([p], sp)[0].token_ids
    others = prompts(3, [11, 30, 7], seed=6)
    crowd = engine.generate(
        [others[0], p, others[1], others[2]],
        [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True), sp,
         SamplingParams(max_tokens=9, temperature=0.5, seed=1, ignore_eos=True), GREEDY],
    )[1].token_ids
    assert alone == crowd
    other_seed = engine.generate([p], SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone
    assert_leak_free(engine)


def test_top_k_1_is_greedy(engine, tiny_model):
    p = prompts(1, [25], seed=7)[0]
    out = engine.generate([p], SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny_model, p, 8)


def test_stop_token_ids_and_eos(engine, tiny_model):
    p = prompts(1, [18], seed=8)[0]
    ref = hf_greedy(tiny_model, p, 12)
    stop_at = ref[4]
    first = ref.index(stop_at)
    out = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    assert_leak_free(engine)


def test_stop_string_truncates_text_and_finishes(engine, tiny_model):
    # Printable prompt bytes; find what the model says, then stop on a piece of it.
    p = [256] + list(b"The quick brown fox jumps")
    full = engine.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    out = engine.generate([p], SamplingParams(max_tokens=20, temperature=0, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert_leak_free(engine)
