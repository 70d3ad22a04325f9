"""Write a layer-skip self-draft of a checkpoint: its first N decoder layers, the final norm and
the LM head (and the embeddings), for `speculative: {method: draft, draft_model: DST}`.

    python -m cluster.tools.make_draft --layers 8 SRC DST      # SRC: a checkpoint dir, or "smollm2"

The draft shares the model's tokenizer and vocabulary by construction (the tokenizer files are
copied as they are), and its first N layers are exactly the model's: its hidden state after layer
N is the model's, read out early through the model's own norm and head. That is a cheap draft
with no training (a "self-speculative" early exit); how often the model agrees with it depends on
N and on the text: measure with `python -m cluster.tools.bench.spec --method draft`. On
SmolLM2-135M-Instruct (30 layers) early exit is a weak draft: greedy, two copy prompts, 48
tokens, k 4, drafts accepted were 3% with the first 8 layers, 7% with 16, 35% with 24 (and 100%
with all 30, the check that the machinery is exact). Skipping middle layers instead (first 20 +
last 6) did no better (30%).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from cluster.engine.model.loader import safetensors_files

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def make_draft(src: str | Path, dst: str | Path, layers: int) -> Path:
    """Write the draft to `dst` (created; must not exist). Returns it."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in 1..{total} (the model's layers), got {layers}")
    dst.mkdir(parents=True, exist_ok=False)
    tensors = {}
    for path in safetensors_files(src):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():  # tokenizer, generation config, ...: as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the first ones)")
    ap.add_argument("src", help='the model\'s checkpoint directory, or "smollm2" for the demo model')
    ap.add_argument("dst", help="the draft's directory (must not exist)")
    args = ap.parse_args(argv)
    src = args.src
    if src == "smollm2":
        from cluster.engine.model.demo import smollm2_135m_instruct  # noqa: PLC0415 — fetches once

        src = smollm2_135m_instruct()
    out = make_draft(src, args.dst, args.layers)
    print(f"wrote {out}: the first {args.layers} layers of {src}")


if __name__ == "__main__":
    main()
