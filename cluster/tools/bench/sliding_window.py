"""Sliding-window decode attention against full attention, the CPU paged kernel (attention/window.py):
32 rows at 8,192 tokens each, window 512 (Gemma 3's 1B window), median of 20 calls per arm.

    python -m cluster.tools.bench.sliding_window
"""
import time

import torch

from cluster.engine.kernels import cpu


def main() -> None:
    cpu.load()
    torch.manual_seed(0)
    B, L, W, bs, H, Hkv, D = 32, 8192, 512, 16, 8, 4, 64
    nb = B * L // bs
    k, v = torch.randn(nb, bs, Hkv, D), torch.randn(nb, bs, Hkv, D)
    tables = torch.randperm(nb).view(B, L // bs).int()
    lens = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, H, D)
    op = torch.ops.pdserve_cpu.paged_decode

    def t(window: int, reps: int = 20) -> float:  # median ms of `reps` calls, after one warm-up
        op(q, k, v, tables, lens, 0.125, window)
        ts = []
        for _ in range(reps):
            start = time.perf_counter()
            op(q, k, v, tables, lens, 0.125, window)
            ts.append(time.perf_counter() - start)
        return sorted(ts)[reps // 2] * 1e3

    full, win = t(0), t(W)
    print(f"paged_decode {B} rows x {L} tokens, H {H}/{Hkv}, D {D}, {torch.get_num_threads()} threads: "
          f"full {full:.2f} ms, window {W} {win:.2f} ms, ratio {win / full:.3f}")


if __name__ == "__main__":
    main()
