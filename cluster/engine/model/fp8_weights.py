"""Block-scaled fp8 weights (families/base.py: WeightQuant) dequantized at load to the run dtype.

A quantised linear's checkpoint tensors are `<name>.weight` (float8_e4m3fn, [..., N, K]) and
`<name>.weight_scale_inv` (float32, [..., ceil(N / rows), ceil(K / cols)]): weight[i, j] *
scale_inv[i // rows, j // cols] is the real weight (DeepSeek-V3's weight_dequant; transformers'
FP8Linear). The scales are read first (a sharded checkpoint may keep one in another file than its
weight); every fp8 weight needs its scale and every scale its weight.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from cluster.engine.model.families.base import WeightQuant

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" + this


def read_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every `*.weight_scale_inv` tensor, by the name of the weight it scales."""
    scales = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(".weight" + SCALE_SUFFIX):
                    scales[name.removesuffix(SCALE_SUFFIX)] = f.get_tensor(name)
    return scales


def dequantize(name: str, weight: torch.Tensor, scales: dict[str, torch.Tensor], quant: WeightQuant | None,
               dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as the model's parameter takes it: an fp8 weight times its block scales,
    in `dtype`; any other tensor unchanged. Pops the weight's scale from `scales`."""
    if weight.dtype != torch.float8_e4m3fn:
        return weight
    if quant is None:
        raise ValueError(f"checkpoint tensor {name!r} is float8_e4m3fn but config.json has no quantization_config")
    scale = scales.pop(name, None)
    if scale is None:
        raise ValueError(f"checkpoint tensor {name!r} is float8_e4m3fn and has no {name + SCALE_SUFFIX!r}")
    rows, cols = quant.block
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-n // rows), -(-k // cols))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name + SCALE_SUFFIX}: shape {tuple(scale.shape)} does not cover {name} "
                         f"{tuple(weight.shape)} in weight_block_size [{rows}, {cols}] blocks (expected {want})")
    full = scale.float().repeat_interleave(rows, -2)[..., :n, :].repeat_interleave(cols, -1)[..., :k]
    return (weight.float() * full).to(dtype)


def check_scales_used(scales: dict[str, torch.Tensor]) -> None:
    """Scales dequantize() did not pop belong to no fp8 weight."""
    if scales:
        names = sorted(scales)[:3]
        raise ValueError(f"{len(scales)} weight_scale_inv tensors scale no float8_e4m3fn weight, e.g. "
                         f"{[n + SCALE_SUFFIX for n in names]}")
