"""`pdserve profile`: measure an engine's step costs on this machine, in-process (no Ray).

    prefill: one step that computes N new prompt tokens after C cached ones (C = 0: a fresh
             prompt; C > 0: the C-token prefix was computed by an earlier request and is found in
             the prefix cache; checked: the output's cached tokens must equal C)
    decode:  one step of B requests, one token each, at context L. The B requests have distinct
             L-token prompts and are admitted as a decode replica admits a prompt prefilled
             elsewhere (`import_request`, then `activate`): their KV is taken as written by a peer,
             so a point costs no prefill. A step reads the same memory whatever the values in it,
             and each request its own blocks, as a server's requests do. (A batch sharing a
             prefix reads the same blocks, warm in the CPU's caches: on the dev VM's bench model
             such steps took half the time at batch 32-64 and 1-2k tokens of context, 80.6
             against 162.7 ms at 32 x 2,048 and 147.5 against 347.2 ms at 64 x 2,048; 0-9% less
             at batch 1-7 and 256 tokens.)
    KV bytes per token: the engine's block bytes / block size (exact, not timed)
    sharing (--sharing N, CPUs): n = 1..N engine processes (each on this process's torch threads)
             step at once, each a 128-token prefill step then a decode step of 4 at context 256,
             again and again for a few seconds; per n, a step's median time over its median time
             alone (the geometric mean of the two kinds). What replicas sharing one machine's
             cores cost one another, contention for the cores and their caches and memory
             included: `pdserve plan --cores` prices with it (cluster/planner/simulator.py)

Each point is the median of `reps` timed steps (engine.step(), the whole step: schedule, forward,
sampling, outputs), after one untimed warm-up step. KV transfer time is not measured here: it needs
two processes with NIXL (`python -m cluster.tools.bench.kv_transfer` measures it); the profile
records it as not measured, and the plan takes `--transfer-gbps` instead.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
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
# the engine's default max_num_seqs (64); about three minutes for SmolLM2-135M on 2 CPU cores. Every
# chunk size `pdserve plan` searches (256, 512, 1024) is a point: a chunk-sized step is the most
# common step of a prompt longer than the chunk, and a line between the points next to it can be
# far off (an Intel Xeon VM, 2026-12-07: 512 tokens took 831 ms where the line from 256 to 1,024
# said 1,026).
PREFILL_TOKENS = (16, 64, 256, 512, 1024)
PREFILL_CACHED = (0, 1024, 2048)
# Every batch up to 6: CPU step time is not linear there (the dev VM's bench model: 16.9 ms at 4,
# 24.7 ms at 5, where a line from 4 to 8 says 21).
DECODE_BATCH = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64)
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

    def run_out(self) -> None:
        """Step until nothing is left unfinished."""
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
            self.run_out()
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

    def pilot_prefill(self, n: int) -> float:
        """One untimed-as-a-point prefill step of n fresh tokens: seconds (for the estimates)."""
        self._add(self._tokens(n), 1)
        dt, _ = self._timed_step()
        self.run_out()
        return dt

    def pilot_decode(self, batch: int, context: int) -> float:
        reps, self.reps = self.reps, 1
        try:
            return self.decode(batch, context)  # a warm-up step and one timed
        finally:
            self.reps = reps

    def import_decodes(self, batch: int, context: int, max_tokens: int) -> list[str]:
        """`batch` requests of distinct `context`-token prompts, imported as decode takes a pulled
        prompt (nothing computed here) and decoding from the next step; their ids."""
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        ids = []
        for _ in range(batch):
            self._n += 1
            req = self.engine.make_request(f"profile-{self._n}", prompt_token_ids=self._tokens(context), sampling=sp)
            first = self._tokens(1)[0]
            if self.engine.import_request(req, self.engine.full_block_hashes(req), context, first) != 0:
                raise RuntimeError(f"decode point ({batch}, {context}): no room to admit {batch} requests "
                                   "of distinct prompts, or one was found cached")
            self.engine.activate(req.request_id, context, first)
            ids.append(req.request_id)
        return ids

    def fresh_prompt(self, n: int, max_tokens: int) -> str:
        """A request of n fresh random tokens added to the engine; its id."""
        return self._add(self._tokens(n), max_tokens)

    def decode(self, batch: int, context: int) -> float:
        """Median seconds of a decode step of `batch` requests at context `context`."""
        ids = self.import_decodes(batch, context, self.reps + 3)
        times = []
        for rep in range(self.reps + 1):
            dt, outs = self._timed_step()
            if len(outs) != batch or any(len(o.token_ids) != 1 for o in outs):
                raise RuntimeError(f"decode point ({batch}, {context}): expected {batch} one-token outputs")
            if rep:
                times.append(dt)
        for rid in ids:
            self.engine.abort(rid)
        self.run_out()
        return statistics.median(times)


SHARING_PREFILL, SHARING_DECODE = 128, (4, 256)


def _sharing_worker(model: str, device: str, dtype: str, block_size: int, threads: int, seconds: float,
                    barrier, results) -> None:
    torch.set_num_threads(threads)
    engine = engine_for(model, [SHARING_PREFILL], [0], [SHARING_DECODE[0]], [SHARING_DECODE[1]], device, dtype,
                        block_size)
    cal = Calibrator(engine, reps=1, log=lambda _: None)
    cal.prefill(SHARING_PREFILL, 0)  # warm-up, alone
    cal.decode(*SHARING_DECODE)
    barrier.wait()
    prefill, decode = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        prefill.append(cal.prefill(SHARING_PREFILL, 0))
        decode.append(cal.decode(*SHARING_DECODE))
    results.put((prefill, decode))


def sharing_factor(runs: Sequence[tuple[Sequence[float], Sequence[float]]],
                   alone: tuple[float, float] | None) -> tuple[float, float, float]:
    """Step times of processes stepping at once, each's (prefill seconds, decode seconds) -> the
    median prefill and decode step over all of them, and their slow-down over `alone` (the two
    medians of one process; None: this is that point, 1.0): the geometric mean of the two ratios,
    to 4 places, so neither kind of step outweighs the other."""
    prefill = statistics.median(t for r in runs for t in r[0])
    decode = statistics.median(t for r in runs for t in r[1])
    base = alone or (prefill, decode)
    return prefill, decode, round(((prefill / base[0]) * (decode / base[1])) ** 0.5, 4)


def measure_sharing(model: str, processes: int, seconds: float = 10.0, device: str = "cpu", dtype: str = "auto",
                    block_size: int = 16, log: Callable[[str], None] = print) -> tuple[float, ...]:
    """Per n = 1..processes engine processes stepping at once, a step's time over its time alone."""
    import multiprocessing  # noqa: PLC0415

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no torch state forked
    alone, factors = None, []
    for n in range(1, processes + 1):
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_sharing_worker, daemon=True,
                             args=(model, device, dtype, block_size, torch.get_num_threads(), seconds, barrier,
                                   results)) for _ in range(n)]
        for p in procs:
            p.start()
        try:
            runs = [results.get(timeout=seconds + 300) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        prefill, decode, factor = sharing_factor(runs, alone)
        if alone is None:
            alone = (prefill, decode)
        factors.append(factor)
        log(f"sharing: {n} engine processes at once: prefill {SHARING_PREFILL} tokens {prefill * 1e3:.1f} ms "
            f"({prefill / alone[0]:.2f}x), decode {SHARING_DECODE[0]} x {SHARING_DECODE[1]} {decode * 1e3:.1f} ms "
            f"({decode / alone[1]:.2f}x): {factor:.2f}x")
    return tuple(factors)


def engine_for(model: str, prefill_tokens: Sequence[int], prefill_cached: Sequence[int],
               decode_batch: Sequence[int], decode_context: Sequence[int], device: str = "auto",
               dtype: str = "auto", block_size: int = 16) -> LLMEngine:
    """An engine whose token budget and KV pool hold the largest point of the grid: the largest
    decode point's batch x context tokens of distinct KV (SmolLM2-135M in fp32 on the default grid,
    64 x 2,048: ~6 GB), as a server running that batch holds."""
    longest_prompt = max(prefill_tokens) + max(prefill_cached)
    decode_blocks = max(decode_batch) * (max(decode_context) // block_size + 1)
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
    # cores: the machine's, which replicas on it share (`pdserve plan` prices with them)
    return {"kind": "cpu", "name": name, "threads": torch.get_num_threads(), "cores": os.cpu_count()}


class Progress:
    """A line per measured point: what it measured, the time spent, and the time left by the
    estimates so far (scaled by how the points measured compare with their estimates)."""

    def __init__(self, estimates: Sequence[float], log: Callable[[str], None]):
        self.estimates, self.log = list(estimates), log
        self.k, self.spent_est, self.t0 = 0, 0.0, time.perf_counter()

    def point(self, text: str) -> None:
        self.k += 1
        self.spent_est += self.estimates[self.k - 1]
        elapsed = time.perf_counter() - self.t0
        left = sum(self.estimates[self.k:]) * (elapsed / self.spent_est if self.spent_est > 0 else 1.0)
        self.log(f"[{self.k}/{len(self.estimates)}] {text}  ({elapsed:.0f} s, ~{left:.0f} s left)")


def grid_estimates(cal: "Calibrator", prefill_tokens: Sequence[int], prefill_cached: Sequence[int],
                   decode_batch: Sequence[int], decode_context: Sequence[int]) -> list[float]:
    """Seconds each point of the grid should take, from two pilot steps (a prefill of up to 256
    tokens, a decode of up to 4 rows at the smallest context): a rough model (prefill time by
    tokens, the cached prefix's own prefill; decode by rows and context), refined as points finish."""
    n0 = min(256, max(prefill_tokens))
    per_token = cal.pilot_prefill(n0) / n0
    b0 = min(4, max(decode_batch))
    per_row = cal.pilot_decode(b0, min(decode_context)) / b0
    steps = cal.reps + 1
    # (a chunk after c cached tokens: ~0.4 more a token per 1,024 of them, SmolLM2 on the dev VM)
    est = [steps * per_token * n * (1 + 0.4 * c / 1024) + per_token * c
           for n in prefill_tokens for c in prefill_cached]
    est += [steps * per_row * (2 + b) * (1 + ctx / 2048) / 3 + 0.002 * b
            for b in decode_batch for ctx in decode_context]
    return est


def _measure_grid(cal: "Calibrator", prefill_tokens, prefill_cached, decode_batch, decode_context,
                  announce: Callable[[float], None] | None):
    estimates = grid_estimates(cal, prefill_tokens, prefill_cached, decode_batch, decode_context)
    if announce is not None:
        announce(sum(estimates))
    progress = Progress(estimates, cal.log)
    prefill, decode = [], []
    for n in prefill_tokens:
        prefill.append([])
        for c in prefill_cached:
            prefill[-1].append(cal.prefill(n, c))
            progress.point(f"prefill {n} tokens after {c} cached: {prefill[-1][-1] * 1e3:.1f} ms")
    for b in decode_batch:
        decode.append([])
        for ctx in decode_context:
            decode[-1].append(cal.decode(b, ctx))
            progress.point(f"decode batch {b} at context {ctx}: {decode[-1][-1] * 1e3:.1f} ms")
    for name, values, xs, ys, measure in (("prefill", prefill, prefill_tokens, prefill_cached, cal.prefill),
                                          ("decode", decode, decode_batch, decode_context, cal.decode)):
        for i, j in outliers(values):  # once more; the lower median stands (noise only adds time)
            again = measure(xs[i], ys[j])
            cal.log(f"{name} ({xs[i]}, {ys[j]}): {values[i][j] * 1e3:.1f} ms was above a larger point's; "
                    f"again {again * 1e3:.1f} ms")
            values[i][j] = min(values[i][j], again)
    return prefill, decode


def outliers(values: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Grid points whose time is above a point's with more work on either axis (more tokens or
    rows, more context): a step's time grows along both, so such a point was slowed by something
    else on the machine (or its neighbour was fast by chance: re-measuring keeps the lower)."""
    n, m = len(values), len(values[0]) if values else 0
    return [(i, j) for i in range(n) for j in range(m)
            if (i + 1 < n and values[i][j] > values[i + 1][j]) or (j + 1 < m and values[i][j] > values[i][j + 1])]


def calibrate(model: str, prefill_tokens: Sequence[int] = PREFILL_TOKENS,
              prefill_cached: Sequence[int] = PREFILL_CACHED, decode_batch: Sequence[int] = DECODE_BATCH,
              decode_context: Sequence[int] = DECODE_CONTEXT, reps: int = 3, device: str = "auto",
              dtype: str = "auto", block_size: int = 16, seed: int = 0,
              log: Callable[[str], None] = print, sharing: int = 0, threads: int | None = None,
              announce: Callable[[float], None] | None = None) -> Profile:
    """`sharing` > 0 (CPU only): also measure the slowdown of up to that many engine processes at
    once. `threads`: torch's threads while measuring (a replica's: its pool's num_cpus, 1 by
    default, which Ray gives it as OMP_NUM_THREADS); None: this process's. `announce(seconds)`: the
    grid's expected duration, once known (after two pilot steps)."""
    started = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    prefill_tokens, prefill_cached = sorted(set(prefill_tokens)), sorted(set(prefill_cached))
    decode_batch, decode_context = sorted(set(decode_batch)), sorted(set(decode_context))
    for c in [*prefill_cached, *decode_context]:
        if c % block_size or (c == 0 and c in decode_context):
            raise ValueError(f"cached and context points must be positive multiples of the block size "
                             f"({block_size}); got {c}")
    engine = engine_for(model, prefill_tokens, prefill_cached, decode_batch, decode_context, device, dtype,
                        block_size)
    if sharing and engine.device.type != "cpu":
        raise ValueError("--sharing measures replicas sharing one machine's CPU cores; this engine runs on "
                         f"{engine.device.type} (a device per replica shares nothing)")
    cal = Calibrator(engine, reps, seed, log)
    cal.prefill(min(prefill_tokens), 0)  # warm-up of the whole path, untimed
    prefill, decode = _measure_grid(cal, prefill_tokens, prefill_cached, decode_batch, decode_context, announce)
    shared: tuple[float, ...] = ()
    if sharing:
        shared = measure_sharing(model, sharing, device="cpu", dtype=dtype, block_size=block_size, log=log)
    return _profile(model, engine, reps, block_size, prefill_tokens, prefill_cached, decode_batch, decode_context,
                    prefill, decode, shared, started)


def _profile(model, engine, reps, block_size, prefill_tokens, prefill_cached, decode_batch, decode_context,
             prefill, decode, shared, started) -> Profile:
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
               "decode points: distinct prompts, admitted as imported (their KV not computed)"),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        wall_s=round(time.perf_counter() - started, 1),
        sharing=shared,
    )
