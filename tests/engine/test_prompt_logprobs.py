"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what `echo` with `logprobs` returns): each
prompt token's raw logprob given the tokens before it and the top k, equal to transformers'
log_softmax within 1e-4, however the prompt is chunked, and never served from the prefix cache."""

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from tests.reference import hf_prompt_logprobs

PROMPT = [256] + [(5 * k + 11) % 256 for k in range(39)]  # 40 tokens


def assert_equal_reference(got, want) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for i, (g, (lp, top)) in enumerate(zip(got[1:], want[1:]), start=1):
        assert g.token_id == PROMPT[i], i
        assert abs(g.logprob - lp) < 1e-4, i
        assert [t for t, _ in g.top] == [t for t, _ in top], i
        assert max(abs(v - w) for (_, v), (_, w) in zip(g.top, top)) < 1e-4, i


@pytest.mark.parametrize("chunk", [512, 16, 7])  # the prompt in one step, in 3 and in 6 chunks
def test_prompt_logprobs_equal_transformers_however_the_prompt_is_chunked(tiny_model, chunk):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64, max_num_batched_tokens=chunk)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=4))[0]
    assert_equal_reference(out.prompt_logprobs, hf_prompt_logprobs(tiny_model, PROMPT, 4))
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_they_come_once(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))  # the prompt's 2 full blocks cached
    cached = engine.stats.cached_prompt_tokens
    engine.add_request("r", prompt_token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.stats.cached_prompt_tokens == cached  # nothing taken from the cache
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False, False]
    want = hf_prompt_logprobs(tiny_model, PROMPT, 1)
    assert all(g.top == () for g in outs[0].prompt_logprobs[1:])
    assert max(abs(g.logprob - w[0]) for g, w in zip(outs[0].prompt_logprobs[1:], want[1:])) < 1e-4


def test_prompt_logprobs_over_the_cap_are_refused_naming_the_field(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=16)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", prompt_token_ids=PROMPT, sampling=SamplingParams(prompt_logprobs=21))
    assert (e.value.field, str(e.value)) == ("prompt_logprobs", "prompt_logprobs: asks for 21 top logprobs; at most 20 are accepted")
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=-1)
    assert e.value.field == "prompt_logprobs"


def test_a_leg_that_continues_after_tokens_sent_elsewhere_sends_no_prompt_logprobs(tiny_model):
    """A decode leg after a remote first token, or a migrated one: the prompt's logprobs went out
    with the first token; the leg computes the prompt without scoring it again."""
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    [full] = engine.generate([PROMPT], sp)
    req = engine.make_request("leg", None, PROMPT, sp)
    engine.add_after_tokens(req, full.token_ids[:2])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == full.token_ids[2:]
    assert all(o.prompt_logprobs is None for o in outs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
