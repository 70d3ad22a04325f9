"""Backend registry: each backend is imported only when chosen; "auto" is resolved once, logged.

"auto" is cpu_paged on CPU float32 when the kernels build (decode attention in place in the paged
pool: 1.20x torch at 64 streams on the 50M benchmark model, 2 threads; docs/benchmarks.md, issue 24
session 11; steps of at most 32 decodes take the fused layers, which use the same kernel whatever
the backend), else torch. The others are opt-in:
- flash_attn (CUDA, block_size % 256 == 0): never yet run on a GPU (no wheel on PyPI; its build does
  not fit a lent machine's time).
On CUDA, decode-only steps do not use the backend's attend: they take the static decode path
(cluster/engine/static_decode.py, captured as CUDA graphs) with its own paged kernel
(paged_decode.py); the backend serves prefill chunks and mixed steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Protocol

import torch

from cluster.engine.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

_BACKENDS = {
    "torch": "cluster.engine.attention.torch_sdpa:TorchSDPABackend",
    "flash_attn": "cluster.engine.attention.flash_attn:FlashAttnBackend",
    "cpu_paged": "cluster.engine.attention.cpu_paged:CPUPagedBackend",
}


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's keys/values. k_cache: [num_blocks, block_size, H_kv, D]; k: [T, H_kv, D]."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, H_kv, D] (this step's, already in the cache) -> [T, H, D]."""


def flash_attn_usable(device: torch.device, block_size: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "not on CUDA"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash_attn is not installed (pip install 'pdserve[gpu]')"
    if block_size % 256 != 0:
        return False, f"flash-attn 2 paged KV needs block_size % 256 == 0, got {block_size}"
    return True, "flash_attn installed, CUDA device"


def cpu_paged_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, "not on CPU"
    if dtype != torch.float32:
        return False, f"the CPU kernels are float32 only, the model is {dtype}"
    from cluster.engine.kernels import cpu as cpu_kernels  # noqa: PLC0415 — builds only when asked

    try:
        return True, f"CPU kernels loaded from {cpu_kernels.load()}"
    except cpu_kernels.KernelUnavailable as e:
        return False, str(e)


def resolve_backend(name: str, device: torch.device, block_size: int,
                    dtype: torch.dtype = torch.float32) -> AttentionBackend:
    if name == "auto":
        ok, why = cpu_paged_usable(device, dtype)
        name = "cpu_paged" if ok else "torch"
        log.info("attention backend auto -> %s (%s)", name, why)
    elif name == "cpu_paged":
        ok, why = cpu_paged_usable(device, dtype)
        if not ok:
            raise ValueError(f"attention_backend=cpu_paged is not usable here: {why}")
    elif name == "flash_attn":
        ok, why = flash_attn_usable(device, block_size)
        if not ok:
            raise ValueError(f"attention_backend=flash_attn is not usable here: {why}")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown (choose from auto, {', '.join(_BACKENDS)})")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
