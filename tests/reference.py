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


def hf_prompt_logprobs(model_dir: str, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per prompt token: None for the first, else (its logprob given the tokens before it, the top k)."""
    with torch.inference_mode():
        lp = torch.log_softmax(hf_model(model_dir)(torch.tensor([tokens])).logits[0].float(), dim=-1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    return [None] + [(float(lp[i - 1, t]), list(zip(top_ids[i - 1].tolist(), top_lp[i - 1].tolist())))
                     for i, t in enumerate(tokens) if i]
