"""flash-attn backend equals the torch backend on the same inputs (CUDA only)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_flash_attn_backend_equals_torch_backend(model_factory):
    pytest.importorskip("flash_attn")
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.sampling_params import SamplingParams

    d = model_factory("gpu", layers=2, hidden=128, heads=4, kv_heads=2, vocab=320, dtype="bfloat16")
    prompts = [[256] + list(range(1, n)) for n in (5, 300, 700)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    logits = {}
    for backend in ("torch", "flash_attn"):
        eng = LLMEngine.from_model(d, device="cuda", block_size=256, num_blocks=16,
                                   attention_backend=backend, max_num_batched_tokens=256)
        captured = []
        orig = eng.runner.sampler.sample
        eng.runner.sampler.sample = lambda lg, reqs: (captured.append(lg.clone()), orig(lg, reqs))[1]
        outs[backend] = [o.token_ids for o in eng.generate(prompts, sp)]
        logits[backend] = captured
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert outs["flash_attn"] == outs["torch"]
    for a, b in zip(logits["torch"], logits["flash_attn"]):
        assert torch.allclose(a, b, atol=5e-2, rtol=0)


def test_kv_pool_lives_in_cuda_memory(tiny_model):
    from cluster.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_model(tiny_model, device="cuda", num_blocks=32)
    assert eng.kv_cache.is_cuda and eng.kv_cache.is_contiguous()
