"""A checkpoint by Hub name: `--model Qwen/Qwen3-8B` as vLLM takes it.

A path to a directory is the checkpoint, as before. Anything else is a Hugging Face Hub repo id,
resolved by huggingface_hub's snapshot_download to a snapshot directory in its cache (HF_HOME /
HF_HUB_CACHE; downloaded once, later runs find it there). HF_HUB_OFFLINE=1 honoured: only the cache
is read. Only the files the engine reads are fetched (config, generation config, safetensors,
tokenizer, chat templates), not a repository's other weight formats.
"""

from __future__ import annotations

from pathlib import Path

# What the engine reads from a checkpoint directory (model_config, loader, tokenizer, chat_template).
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja"]


def resolve_checkpoint(model: str, field: str = "model") -> str:
    """`model` as a local checkpoint directory: itself if it is a directory, else the Hub snapshot
    of that repo id. Raises ValueError naming `field` when it is neither."""
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    from huggingface_hub import snapshot_download  # noqa: PLC0415 — only for a Hub name
    from huggingface_hub.errors import HFValidationError  # noqa: PLC0415

    try:
        return snapshot_download(model, allow_patterns=ALLOW_PATTERNS)
    except HFValidationError as e:
        raise ValueError(f"{field}={model!r} is neither a checkpoint directory nor a Hugging Face Hub repo id "
                         f"(org/name): {e}") from e
    except Exception as e:  # noqa: BLE001 — the Hub's errors (offline, not found, gated, network) are many
        raise ValueError(f"{field}={model!r} is not a checkpoint directory, and the Hugging Face Hub could not "
                         f"resolve it as a repo id ({type(e).__name__}: {e})") from e
