"""`pdserve profile`: measure an engine's step costs on this machine, in-process (no Ray).

    prefill: one step that computes N new prompt tokens after C cached ones (C = 0: a fresh
             prompt; C > 0: the C-token prefix was computed by an earlier request and is found in
             the prefix cache; checked: the output's cached tokens must equal C)
    decode:  one step of B requests, one token each, at context ~L (after all B are prefilled).
             The B prompts share an (L - block_size)-token prefix and differ in their last block,
             so profiling B x L costs one L-token prefill, not B; attention still reads L tokens
             per request (shared blocks may sit warmer in a CPU cache than B distinct ones would)
    KV bytes per token: the engine's block bytes / block size (exact, not timed)

Each point is the median of `reps` timed steps (engine.step(), the whole step: schedule, forward,
sampling, outputs), after one untimed warm-up step. KV transfer time is not measured here: it needs
two processes with NIXL (`python -m cluster.tools.bench.kv_transfer` measures it); the profile
records it as not measured, and the plan takes `--transfer-gbps` instead.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import random
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.planner.profile import Curve, Profile

# The default grid: contexts up to 2,048 tokens (prompt + output), chunks up to 1,024, batches up to
# the engine's default max_num_seqs (64); about two minutes for SmolLM2-135M on 2 CPU cores.
PREFILL_TOKENS = (16, 64, 256, 1024)
PREFILL_CACHED = (0, 1024, 2048)
DECODE_BATCH = (1, 8, 32, 64)
DECODE_CONTEXT = (128, 1024, 2048)


class Calibrator:
    def __init__(self, engine: LLMEngine, reps: int = 3, seed: int = 0, log: Callable[[str], None] = print):
        self.engine, self.reps, self.log = engine, reps, log
        self.rng = random.Random(seed)
        self._n = 0
        vocab = engine.model_config.vocab_size
        self._lo, self._hi = min(100, vocab // 4), vocab - 1

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randint(self._lo, self._hi) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"profile-{self._n}"
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(rid, prompt_token_ids=prompt, sampling=sp)
        return rid

    def _run_out(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _timed_step(self):
        t = time.perf_counter()
        outs = self.engine.step()
        return time.perf_counter() - t, outs

    def prefill(self, n: int, cached: int) -> float:
        """Median seconds of a step computing n prompt tokens after `cached` cached ones."""
        prefix = self._tokens(cached)
        if cached:
            self._add(prefix, 1)
            self._run_out()
        times = []
        for rep in range(self.reps + 1):
            self._add(prefix + self._tokens(n), 1)
            dt, outs = self._timed_step()
            [out] = outs
            if not out.finished or out.num_cached_tokens != cached:
                raise RuntimeError(f"prefill point ({n}, {cached}): one step should finish the prompt with "
                                   f"{cached} cached tokens; got finished={out.finished}, "
                                   f"cached={out.num_cached_tokens} (is the KV pool large enough?)")
            if rep:  # the first is a warm-up
                times.append(dt)
        return statistics.median(times)

    def decode(self, batch: int, context: int) -> float:
        """Median seconds of a decode step of `batch` requests at context ~`context`."""
        bs = self.engine.block_size
        prefix = self._tokens(context - bs)
        self._add(prefix, 1)
        self._run_out()
        ids = {self._add(prefix + self._tokens(bs), self.reps + 3) for _ in range(batch)}
        started: set[str] = set()
        while started != ids:
            started |= {o.request_id for o in self.engine.step() if o.token_ids}
        times = []
        for rep in range(self.reps + 1):
            dt, outs = self._timed_step()
            if len(outs) != batch or any(len(o.token_ids) != 1 for o in outs):
                raise RuntimeError(f"decode point ({batch}, {context}): expected {batch} one-token outputs")
            if rep:
                times.append(dt)
        for rid in ids:
            self.engine.abort(rid)
        self._run_out()
        return statistics.median(times)


def engine_for(model: str, prefill_tokens: Sequence[int], prefill_cached: Sequence[int],
               decode_batch: Sequence[int], decode_context: Sequence[int], device: str = "auto",
               dtype: str = "auto", block_size: int = 16) -> LLMEngine:
    """An engine whose token budget and KV pool hold the largest point of the grid."""
    longest_prompt = max(prefill_tokens) + max(prefill_cached)
    decode_blocks = max(decode_context) // block_size + max(decode_batch) * 3
    return LLMEngine.from_model(
        model, device=device, dtype=dtype, block_size=block_size,
        max_num_batched_tokens=max(max(prefill_tokens), max(decode_batch)),
        max_num_seqs=max(decode_batch), num_blocks=2 * (longest_prompt // block_size) + decode_blocks + 8,
        max_model_len=max(longest_prompt, max(decode_context)) + 16)


def device_info(engine: LLMEngine) -> dict:
    dev = engine.device
    if dev.type == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(dev)}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "threads": torch.get_num_threads()}


def calibrate(model: str, prefill_tokens: Sequence[int] = PREFILL_TOKENS,
              prefill_cached: Sequence[int] = PREFILL_CACHED, decode_batch: Sequence[int] = DECODE_BATCH,
              decode_context: Sequence[int] = DECODE_CONTEXT, reps: int = 3, device: str = "auto",
              dtype: str = "auto", block_size: int = 16, seed: int = 0,
              log: Callable[[str], None] = print) -> Profile:
    started = time.perf_counter()
    prefill_tokens, prefill_cached = sorted(set(prefill_tokens)), sorted(set(prefill_cached))
    decode_batch, decode_context = sorted(set(decode_batch)), sorted(set(decode_context))
    for c in [*prefill_cached, *decode_context]:
        if c % block_size or (c == 0 and c in decode_context):
            raise ValueError(f"cached and context points must be positive multiples of the block size "
                             f"({block_size}); got {c}")
    engine = engine_for(model, prefill_tokens, prefill_cached, decode_batch, decode_context, device, dtype,
                        block_size)
    cal = Calibrator(engine, reps, seed, log)
    cal.prefill(min(prefill_tokens), 0)  # warm-up of the whole path, untimed
    prefill = []
    for n in prefill_tokens:
        row = [cal.prefill(n, c) for c in prefill_cached]
        log(f"prefill {n:>6} tokens after {list(prefill_cached)} cached: " + ", ".join(f"{t * 1e3:.1f} ms" for t in row))
        prefill.append(row)
    decode = []
    for b in decode_batch:
        row = [cal.decode(b, ctx) for ctx in decode_context]
        log(f"decode batch {b:>4} at context {list(decode_context)}: " + ", ".join(f"{t * 1e3:.1f} ms" for t in row))
        decode.append(row)
    mc = engine.model_config
    return Profile(
        model={"path": str(model), "identity": engine.model_identity, "model_type": mc.model_type,
               "layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
               "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size},
        device=device_info(engine),
        versions={"torch": torch.__version__, "pdserve": importlib.metadata.version("pdserve"),
                  "python": sys.version.split()[0]},
        engine={"block_size": block_size, "dtype": str(engine.dtype).removeprefix("torch."),
                "kv_block_bytes": engine.block_bytes, "attention_backend": engine.runner.backend.name,
                "reps": reps},
        prefill=Curve("prefill", "tokens", "cached", prefill_tokens, prefill_cached, prefill),
        decode=Curve("decode", "batch", "context", decode_batch, decode_context, decode),
        transfer=None,
        notes=("transfer not measured (needs two processes with NIXL: python -m cluster.tools.bench.kv_transfer); "
               "the plan takes --transfer-gbps",
               "decode points share a prompt prefix across the batch (one prefill per point)"),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        wall_s=round(time.perf_counter() - started, 1),
    )
