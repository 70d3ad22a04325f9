"""The model's dense ops (linear, RMSNorm, RoPE, SiLU-and-multiply) as a strategy chosen once at load.

`TorchOps` is plain torch and the reference. `CPUKernelOps` (CPU, float32, when the kernels in
cluster/engine/kernels build here) sends a linear over at most SMALL_ROWS rows (decode steps, short
chunks) to a kernel that streams each weight row once for all rows (tiled over rows and weight
rows past a few rows, so it stays ahead of torch's GEMM while a batch grows); larger batches stay
with torch's GEMM. RMSNorm, the residual add with the norm after it, RoPE (in place) and silu(gate) * up are one
kernel call each (a decode step's cost beyond its weights is mostly per-op dispatch). Chosen by measurement
(docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from cluster.engine.model.rope import apply_rope

log = logging.getLogger(__name__)

# Up to here one pass over the weights beats torch's GEMM. The demo model's 120 layer linears (one
# step's worth), 2 threads, the AVX-512 VM (2026-11-26, kernel vs torch, two runs each): 1 row 18.2
# vs 43.4 ms; 8 rows 26.1-29.6 vs 40.0-41.4; 16: 25.7-26.0 vs 49.1-50.2; 40: 51.5-52.0 vs 76.0-77.1;
# 64: 81.4-82.1 vs 103.8-103.9; 128: 159.6-177.9 vs 184.7-201.1; 192: 248.0-248.2 vs 296.3-301.6;
# 256: 318.3-334.9 vs 323.6-324.8 (a tie); 384: 484.9-489.1 vs 485.2-606.4. The 50M benchmark
# model's shapes: the kernel ahead to 256 rows (179 vs 165 GFLOP/s), torch from 512 (181 vs 173).
SMALL_ROWS = 256


# A weight [N, K] with K a multiple of WEIGHT_ALIGN floats (its rows a multiple of 2 KiB apart: K = 512,
# 1024, 1536, 2048, ...) is stored with its rows ROW_PAD floats further apart. The small-row kernel reads
# 12 weight rows at the same column; rows 2 KiB apart fall in two of L1's 64 sets (4 KiB apart: one)
# and evict each other, while one cache line more per row spreads them over all the sets (other
# widths already spread them over 8 or more). 32 rows, the AVX-512 VM (2026-11-26), contiguous vs
# padded: the 50M benchmark model's 48 layer linears (K = 512 but down_proj's 1408), 2 threads, 15.07
# vs 14.34-14.72 ms, its LM head 7.07-7.15 vs 6.93; a Llama-3.2-1B-shaped layer (K = 2048, down
# K = 8192) 21.95-22.31 vs 20.38-21.21 ms, 1 thread 41.75-42.09 vs 38.92-39.54. In the engine (decode
# steps alternated in one process) the 50M model's 32-stream steps gain 0-3%, within this host's
# noise, and one stream's 0.998x. Costs ROW_PAD / K more weight memory (3% at K = 512, 0.8% at 2048).
WEIGHT_ALIGN, ROW_PAD = 512, 16


# Decode-only steps of at most this many requests run the whole layer stack in one kernel call
# (CPUKernelOps.decode_layers): at one stream the ~14 op dispatches a layer cost about as much as the
# layer's non-linear work. Decode step medians, SmolLM2-135M, 129-160-token contexts, the AVX-512 VM
# (2026-11-26), fused vs layer by layer: 1 request 16.7-18.4 vs 23.0-23.9 ms, 4: 26.1-30.1 vs
# 29.6-30.1, 8: 46.8-48.2 vs 50.1-52.1, 16: 66.6-70.6 vs 73.3-74.6, 32: 114.9-116.7 vs 117.8-119.0.
# Larger batches were not measured. Counted in rows: a verify step's drafts are rows too.
FUSED_DECODE_ROWS = 32
# ... and so do steps whose multi-token chunks are this short (a request verifying up to 16 drafts):
# each of their rows attends alone, as a decode over the context up to its own position.
FUSED_MAX_CHUNK = 17


class TorchOps:
    name = "torch"

    @staticmethod
    def fuses(meta) -> bool:
        return False  # the model's layers run one op at a time

    @staticmethod
    def place_weight(weight: torch.Tensor) -> torch.Tensor:
        return weight  # torch's GEMM packs its own panels

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); the norm of the sum."""
        return F.rms_norm(residual.add_(x), weight.shape, weight, eps)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated (rope.apply_rope); the kernel version rotates x in place."""
        return apply_rope(x, cos, signed_sin)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class CPUKernelOps:
    name = "cpu_kernels"

    def __init__(self, fused_decode_rows: int = FUSED_DECODE_ROWS):
        from cluster.engine.kernels import cpu  # noqa: PLC0415 — builds only when chosen

        cpu.load()
        self.fused_decode_rows = fused_decode_rows
        self._decode_layers = torch.ops.pdserve_cpu.decode_layers.default
        self._linear = torch.ops.pdserve_cpu.small_linear.default  # the overload: cheaper to call than the packet
        self._rms_norm = torch.ops.pdserve_cpu.rms_norm.default
        self._add_rms_norm = torch.ops.pdserve_cpu.add_rms_norm.default
        self._rope = torch.ops.pdserve_cpu.rope_.default
        self._silu_mul = torch.ops.pdserve_cpu.silu_mul.default

    @staticmethod
    def place_weight(weight: torch.Tensor) -> torch.Tensor:
        """weight, or a copy whose rows lie ROW_PAD floats further apart (a view [N, K] of an
        [N, K + ROW_PAD] tensor) when K is a multiple of WEIGHT_ALIGN; torch's ops take either."""
        n, k = weight.shape
        if k % WEIGHT_ALIGN or weight.stride() == (k + ROW_PAD, 1):
            return weight
        placed = torch.zeros(n, k + ROW_PAD, dtype=weight.dtype, device=weight.device)[:, :k]
        return placed.copy_(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_ROWS:
            return self._linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps) if x.dim() == 2 else F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and residual.is_contiguous():
            return self._add_rms_norm(x, residual, weight, eps)
        return F.rms_norm(residual.add_(x), weight.shape, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        self._rope(x, cos, signed_sin)
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up) if gate_up.dim() == 2 else TorchOps.silu_mul(gate_up)

    def fuses(self, meta) -> bool:
        """Whether this step's layers run in one decode_layers call."""
        return 0 < meta.slot_blocks.shape[0] <= self.fused_decode_rows and meta.max_q_len <= FUSED_MAX_CHUNK

    def decode_layers(self, x, weights, qkv_bias, kv_cache, meta, cos, sin, num_heads: int, num_kv_heads: int,
                      eps: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's layers in one call, every row attended as a decode by the paged decode kernel
        (the cpu_paged backend's, tested equal to the torch backend): (x, residual) after the last layer."""
        tables, lens = meta.row_tables
        return self._decode_layers(x, weights, qkv_bias, kv_cache, tables, lens, meta.slot_blocks, meta.slot_offsets,
                                   cos, sin, num_heads, num_kv_heads, eps, scale)


TORCH_OPS = TorchOps()


def resolve_ops(name: str, device: torch.device, dtype: torch.dtype,
                fused_decode_rows: int = FUSED_DECODE_ROWS) -> TorchOps | CPUKernelOps:
    """"auto": the CPU kernels on CPU float32 when they build here, else torch; logged.
    fused_decode_rows=0: never the one-call layer stack (a tensor-parallel rank's layers)."""
    if name == "torch":
        return TORCH_OPS
    if device.type != "cpu" or dtype != torch.float32:
        if name == "cpu_kernels":
            raise ValueError(f"model_ops=cpu_kernels needs CPU float32, not {device.type} {dtype}")
        return TORCH_OPS
    from cluster.engine.kernels.cpu import KernelUnavailable  # noqa: PLC0415

    try:
        ops = CPUKernelOps(fused_decode_rows)
    except KernelUnavailable as e:
        if name == "cpu_kernels":
            raise ValueError(f"model_ops=cpu_kernels is not usable here: {e}") from e
        log.info("model ops auto -> torch (%s)", e)
        return TORCH_OPS
    log.info("model ops %s -> cpu_kernels", name)
    return ops
