"""Builds and loads the CPU kernels (csrc/cpu_kernels.cpp) as torch ops (torch.ops.pdserve_cpu.*):
paged decode attention and the KV write (attention/cpu_paged.py), and the small-batch linear,
RMSNorm, RoPE, SiLU-mul and the fused layer stack of a small step (model/ops.py).

Compiled once per (source, torch version, CPU capability) with the system C++ compiler into
~/.cache/pdserve/ext/ and loaded with `torch.ops.load_library`; later processes load the cached
library. The build writes a temporary file and renames it, so two processes building at once
both load a complete library. `load()` raises `KernelUnavailable` when no compiler is there or the
build fails: the attention registry and the model's ops then keep plain torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "ext"
_loaded: Path | None = None


class KernelUnavailable(RuntimeError):
    """The CPU kernels could not be built or loaded here."""


def _arch_flags() -> list[str]:
    cap = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return {"AVX512": ["-mavx512f", "-mavx2", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}.get(cap, [])


def _command(out: Path) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 — only when building

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx}) on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, "-shared", "-fPIC", "-O3", "-std=gnu++17", "-ffp-contract=fast", "-fopenmp", *_arch_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *includes, str(SOURCE), f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}", "-o", str(out)]


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                         + " ".join(_arch_flags()).encode()).hexdigest()[:16]
    return CACHE_DIR / f"pdserve_cpu_{key}.so"


def load() -> Path:
    """Build (once) and load the kernels; afterwards torch.ops.pdserve_cpu.* exist."""
    global _loaded
    if _loaded is not None:
        return _loaded
    lib = library_path()
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=lib.parent)
        os.close(fd)
        log.info("building the CPU kernels into %s (once)", lib)
        try:
            subprocess.run(_command(Path(tmp)), check=True, capture_output=True, text=True, timeout=600)
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise KernelUnavailable(f"building {SOURCE.name} failed: {detail.strip()[-800:]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        torch.ops.load_library(str(lib))
    except OSError as e:
        raise KernelUnavailable(f"loading {lib} failed: {e}") from e
    _loaded = lib
    return lib
