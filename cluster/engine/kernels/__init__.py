"""Compiled CPU kernels (csrc/cpu_kernels.cpp) as torch ops, built once on first use (cpu.py)."""
