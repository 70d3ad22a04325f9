"""What a KV block's contents depend on: the architecture and the weights' bytes.

`model_identity` salts every block hash (engine, router and ingress alike) and is the layout's
`model_fingerprint` that a decode engine checks before pulling KV. The architecture alone (the
old salt) is not enough: two versions of one model (a fine-tune, a re-quantisation) have the same
config.json and different KV for the same tokens, so they must never share a cached block or a
transfer. The weights are hashed once per process (keyed by size and mtime): about half a
second for a 540 MB checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from cluster.engine.model_config import ModelConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weight_files(model_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weights_digest(model_dir: str | Path) -> str:
    """sha256 over the weight files' names and hashes (16 hex digits); '' with no weight files."""
    files = weight_files(model_dir)
    stamp = tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
    return _digest(str(Path(model_dir).resolve()), stamp)


@functools.lru_cache(maxsize=32)
def _digest(root: str, stamp: tuple) -> str:
    if not stamp:
        return ""
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(f"{name}:{file_sha256(Path(root) / name)}\n".encode())
    return h.hexdigest()[:16]


def model_identity(model_dir: str | Path, mc: ModelConfig | None = None) -> str:
    """`<architecture fingerprint>.<weights digest>`."""
    mc = mc or ModelConfig.from_dir(model_dir)
    return f"{mc.fingerprint()}.{weights_digest(model_dir)}"
