"""Penalties, logit bias, min-p and logprobs equal a reference written over transformers' logits.

The reference is deliberately plain (a loop over token ids, the full sequence re-run through
transformers every step); the engine's is batched. Greedy, so the tokens are exact; each case
is chosen so the option changes the output.
"""

from collections import Counter

import pytest
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import merge_outputs
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from tests.reference import hf_last_logits

PROMPT = [256] + [(7 * k + 3) % 256 for k in range(20)]
N = 16


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw)


def reference_processed(logits: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams) -> torch.Tensor:
    """vLLM's order: bias, repetition (prompt + output), frequency and presence (output only)."""
    logits = logits.clone()
    for token, bias in sp.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(out):
        x = logits[token]
        logits[token] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
    for token, count in Counter(out).items():
        logits[token] -= sp.frequency_penalty * count + sp.presence_penalty
    return logits


def reference_greedy(model: str, prompt: list[int], sp: SamplingParams, n: int = N) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = reference_processed(hf_last_logits(model, prompt + out), prompt, out, sp)
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine.from_model(tiny_model, num_blocks=64, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate([PROMPT], greedy())[0].token_ids


def assert_leak_free(engine: LLMEngine):
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert len(engine.runner.sampler._counts) == 0  # every penalised request gave its slot back


CASES = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=0.7),
    "negative_presence": dict(presence_penalty=-2.0),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_one": dict(repetition_penalty=0.5),
    "logit_bias": dict(logit_bias={65: 5.0, 60: -100.0}),
    "all": dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={223: 1.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_processed_greedy_tokens_equal_the_reference_and_change_the_output(engine, tiny_model, plain, case):
    sp = greedy(**CASES[case])
    got = engine.generate([PROMPT], sp)[0].token_ids
    assert got == reference_greedy(tiny_model, PROMPT, sp)
    assert got != plain
    assert_leak_free(engine)


def test_a_batch_mixing_options_gives_each_request_its_own_tokens(engine, tiny_model, plain):
    # Plain, penalised and biased rows in one batch (with chunked prefill): nothing leaks across rows.
    names = ["presence", "repetition", "logit_bias", "all"]
    sps = [greedy()] + [greedy(**CASES[n]) for n in names]
    outs = engine.generate([PROMPT] * len(sps), sps)
    assert outs[0].token_ids == plain
    for name, sp, o in zip(names, sps[1:], outs[1:]):
        assert o.token_ids == reference_greedy(tiny_model, PROMPT, sp), name
    assert_leak_free(engine)


def test_penalties_count_tokens_through_a_preemption(tiny_model):
    # 8 blocks of 4 tokens: two requests of 21 + 16 tokens cannot both stay; one is recomputed
    # from prompt + output, and its counts must be the same as if it had never left.
    tight = LLMEngine.from_model(tiny_model, num_blocks=16, block_size=4, max_num_batched_tokens=64)
    sp = greedy(frequency_penalty=0.7, presence_penalty=0.3)
    outs = tight.generate([PROMPT, PROMPT[:-1] + [9]], sp)
    assert tight.stats.preemptions >= 1
    assert outs[0].token_ids == reference_greedy(tiny_model, PROMPT, sp)
    assert outs[1].token_ids == reference_greedy(tiny_model, PROMPT[:-1] + [9], sp)
    assert_leak_free(tight)


def test_tokens_added_after_the_prompt_count_as_output(engine, tiny_model):
    # A migrated request (or one whose first token came from prefill) resumes with its output so
    # far: the penalties count it as output, and max_tokens includes it.
    sp = greedy(presence_penalty=2.0, frequency_penalty=0.5)
    full = reference_greedy(tiny_model, PROMPT, sp)
    req = engine.make_request("resumed", prompt_token_ids=PROMPT, sampling=sp)
    engine.add_after_tokens(req, full[:5])
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert tokens == full[5:]
    assert_leak_free(engine)


def test_min_p_samples_from_the_reference_distribution(engine, tiny_model):
    """Seeded: the engine draws from a per-request generator seeded with the request's seed, one
    multinomial per token, as the reference does over transformers' logits."""
    sp = SamplingParams(max_tokens=N, temperature=1.0, min_p=0.9, seed=11, ignore_eos=True)
    gen = torch.Generator().manual_seed(11)
    expected: list[int] = []
    kept_counts = []
    for _ in range(N):
        probs = torch.softmax(hf_last_logits(tiny_model, PROMPT + expected), dim=-1)
        kept = torch.where(probs >= 0.9 * probs.max(), probs, 0.0)
        kept_counts.append(int((kept > 0).sum()))
        expected.append(int(torch.multinomial(kept, 1, generator=gen)))
    # min_p leaves a few of the 320 tokens: mostly a real draw among them
    assert max(kept_counts) < 20 and sum(n > 1 for n in kept_counts) >= 10, kept_counts
    got = engine.generate([PROMPT], sp)[0].token_ids
    assert got == expected
    unfiltered = engine.generate([PROMPT], SamplingParams(max_tokens=N, temperature=1.0, seed=11, ignore_eos=True))
    assert unfiltered[0].token_ids != got
    assert_leak_free(engine)


def test_logprobs_equal_transformers_log_softmax(engine, tiny_model):
    # Raw logprobs (before bias and penalties), at the first token (the prefill step) and after.
    sp = greedy(logprobs=5, presence_penalty=1.0, logit_bias={65: 3.0})
    out = engine.generate([PROMPT], sp)[0]
    assert len(out.logprobs) == N and [lp.token_id for lp in out.logprobs] == out.token_ids
    for k, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = torch.log_softmax(hf_last_logits(tiny_model, PROMPT + out.token_ids[:k]), dim=-1)
        assert abs(lp.logprob - float(ref[token])) < 1e-4, k
        top = ref.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist(), k
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist())) < 1e-4, k
    assert out.token_ids == reference_greedy(tiny_model, PROMPT, sp)  # the bias and penalty still applied


def test_logprobs_zero_gives_the_sampled_tokens_alone_and_plain_requests_none(engine, tiny_model, plain):
    with_lp, without = engine.generate([PROMPT, PROMPT], [greedy(logprobs=0), greedy()])
    assert with_lp.token_ids == without.token_ids == plain
    assert [lp.top for lp in with_lp.logprobs] == [()] * N
    ref = torch.log_softmax(hf_last_logits(tiny_model, PROMPT), dim=-1)
    assert abs(with_lp.logprobs[0].logprob - float(ref[plain[0]])) < 1e-4
    assert without.logprobs is None


def test_streamed_deltas_carry_one_logprob_per_token(engine):
    engine.add_request("lp", prompt_token_ids=PROMPT, sampling=greedy(logprobs=2))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert all(len(d.logprobs) == len(d.token_ids) == 1 for d in deltas)
    merged = deltas[0]
    for d in deltas[1:]:
        merged = merge_outputs(merged, d)
    assert [lp.token_id for lp in merged.logprobs] == merged.token_ids


@pytest.mark.parametrize("kw, field, message", [
    (dict(presence_penalty=3), "presence_penalty", "must be in [-2.0, 2.0], got 3"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "must be in [-2.0, 2.0], got -2.5"),
    (dict(repetition_penalty=0), "repetition_penalty", "must be in (0.0, 2.0], got 0"),
    (dict(min_p=1.5), "min_p", "must be in [0.0, 1.0], got 1.5"),
    (dict(logit_bias={5: 1000}), "logit_bias", "must be in [-100.0, 100.0], got 1000"),
    (dict(logit_bias={"5": 1}), "logit_bias", "must be an integer, got '5'"),
    (dict(logit_bias=[(5, 1), (5, 2)]), "logit_bias", "token id 5 appears twice"),
    (dict(logprobs=-1), "logprobs", "must be >= 0, got -1"),
])
def test_bad_values_name_the_field_and_the_limit(kw, field, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert (e.value.field, e.value.message) == (field, message)


@pytest.mark.parametrize("kw, field, message", [
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias", "has 301 entries; at most 300 are accepted"),
    (dict(logit_bias={320: 1.0}), "logit_bias", "token id 320 is outside the vocabulary [0, 320)"),
    (dict(logprobs=21), "logprobs", "asks for 21 top logprobs; at most 20 are accepted"),
])
def test_the_validator_caps_logit_bias_and_logprobs(engine, kw, field, message):
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("r", prompt_token_ids=PROMPT, sampling=SamplingParams(**kw))
    assert (e.value.field, e.value.message) == (field, message)


def test_a_plain_request_is_plain_and_options_are_not():
    assert SamplingParams().plain and SamplingParams(min_p=0.5, temperature=0.7).plain  # min_p acts in the draw
    assert not SamplingParams(presence_penalty=0.1).plain and SamplingParams(presence_penalty=0.1).penalized
    assert not SamplingParams(logit_bias={1: 1}).plain and not SamplingParams(logit_bias={1: 1}).penalized
    assert not SamplingParams(logprobs=0).plain


def test_token_bytes_are_each_tokens_own_bytes(engine):
    tok = engine.tokenizer
    text = "héllo wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode("utf-8")
    assert tok.token_text(ord("A")) == "A" and tok.token_bytes(0xC3) == b"\xc3" and tok.token_text(0xC3) == "\ufffd"
    assert tok.token_bytes(300) == b""  # past the tokenizer's vocabulary (the model's is padded)


def test_a_row_its_own_penalty_makes_non_finite_fails_alone():
    from cluster.engine.request import Request
    from cluster.engine.sampler import Sampler
    from cluster.errors import ErrorKind

    logits = torch.zeros(3, 8)
    logits[0, 2] = 3e38  # finite, but / 0.01 is not: the request's own repetition_penalty breaks it
    logits[1, 5] = 1.0
    logits[2, 6] = 1.0
    reqs = [Request("bad", [2], greedy(repetition_penalty=0.01)), Request("plain", [1], greedy()),
            Request("biased", [1], greedy(logit_bias={3: 2.0}, logprobs=1))]
    sampler = Sampler(0)
    out = sampler.sample(logits, reqs)
    assert out.tokens == {"plain": 5, "biased": 3}
    assert out.failed["bad"].kind == ErrorKind.INVALID_INPUT
    assert out.failed["bad"].reason == "logit_bias and penalties made the logits not finite"
    assert out.logprobs["biased"].token_id == 3 and out.logprobs["biased"].top[0][0] == 6  # raw: before the bias
    for r in reqs:
        sampler.release(r.request_id)
    assert len(sampler._counts) == 0


def test_batched_filtering_equals_each_row_filtered_alone():
    """The sampler filters all sampled rows in one batch; each row's distribution is exactly
    what the same filters give that row alone (a filter a row does not ask for leaves it be)."""
    from cluster.engine.sampler import _filtered_probs

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 4
    rows = [(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.5, 0, 1.0, 0.2),
            (1.0, 5, 0.5, 0.05), (0.9, 299, 0.95, 0.0)]
    col = lambda i, dtype=torch.float32: torch.tensor([r[i] for r in rows], dtype=dtype)[:, None]  # noqa: E731
    batched = _filtered_probs(logits, col(0), col(1, torch.long), col(2), col(3))
    for i, (t, k, p, m) in enumerate(rows):
        alone = _filtered_probs(logits[i : i + 1], torch.tensor([[t]]), torch.tensor([[k]]),
                                torch.tensor([[p]]), torch.tensor([[m]]))
        assert torch.equal(batched[i], alone[0]), rows[i]
        kept = int((alone[0] > 0).sum())
        assert kept == (300 if (k, p, m) == (0, 1.0, 0.0) else kept) and (kept <= k or k == 0)
