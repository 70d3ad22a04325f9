"""The transformers reference: greedy generate and last-position logits on the same checkpoint."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def hf_last_logits(model_dir: str, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0, -1].float()
