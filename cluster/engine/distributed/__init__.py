"""Tensor parallelism (issue 41): a model sharded over tp ranks, collectives through torch.distributed.

plan.py (which heads, rows and vocabulary each rank holds; no torch), layers.py (the parallel
linears, embedding and LM head), loader.py (each rank reads only its slices of the checkpoint),
step.py (what the driver sends its workers each step), driver.py (rank 0, inside LLMEngine),
worker.py (ranks 1..tp-1: execute only), launch.py (ranks as local processes over gloo).
Imported only when tensor_parallel_size > 1.
"""
