"""KV transfer throughput over NIXL between two OS processes, against memcpy in one process.

    python -m cluster.tools.bench.kv_transfer [--lengths 128 512 1024 2048 4096] [--bulk-mib 256]
    python -m cluster.tools.bench.kv_transfer --device cuda --model smollm2-shape --dtype bfloat16 \
        --bulk-mib 1 4 16 64 256 1024          (a GPU machine: both pools and the bulk region in VRAM)
    python -m cluster.tools.bench.kv_transfer --lengths 16 128 --bulk-mib --reps 21   (the fixed cost)

Part 1 (engines): a prefill engine in a child process prefills each prompt; this process's
decode engine pulls all of its blocks (own prefix cache emptied first) with one NIXL READ. For
each length: bytes moved, pull time and bandwidth, a torch copy of the same number of bytes in
this process from cold memory (the memcpy arm; see memcpy_gbps) and the ratio, the cache-hot copy
beside it, descriptors per block, and the prefill time of the same prompt beside the transfer.
Then, in the same run, the bulk arm of the same bytes: a bare NIXL READ of that many contiguous
bytes between two agents in two processes (one descriptor, no engine), and the pull's fixed cost,
engine pull minus that READ: what pdserve adds to moving the bytes. This process's CPU seconds
per wall second over the engine arm and the machine's load average are printed with it.
Part 2 (bulk): one contiguous region per --bulk-mib size registered in both processes and pulled
as one descriptor, against a torch copy of the same size in one process (on CUDA a device-to-device
cudaMemcpy, timed with events, from a window of a buffer larger than L2 that moves each time).
On CUDA, set UCX_PROTO_INFO=y to see which UCX transport carried the bytes (cuda_ipc, cuda_copy).
Only the pull is timed (post + completion), never the handshake: each peer is warmed up first.
All agents run without NIXL's progress thread, as pdserve's do (kv_transfer.progress_thread).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
import tempfile

import torch

from cluster.tools.bench.engine import ensure_bench_model
from cluster.tools.bench.ttft_tpot import model_dir
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from decode.engine import DecodeEngine
from kv_transfer.layout import engine_layout
from cluster.tools.local_peer import PrefillProcess
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.measured import MeasuredTransport
from kv_transfer.transports import available_transports, enable_cuda_ipc_reads


def memcpy_gbps(nbytes: int, reps: int = 7, cold: bool = False) -> float:
    """Median torch copy of `nbytes` between two pre-touched tensors in this process.

    hot: the same buffers every time (after the first copy they sit in cache when they fit).
    cold: a different window of two 512 MiB arenas each time, so the bytes come from DRAM, as a
    pull's do (the prefill process wrote them, not this core)."""
    if not cold:
        src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src).fill_(0.0)  # touch the pages: no first-touch faults in the timing
        dst.copy_(src)
        return nbytes / statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(reps)) / 1e9
    arena = max(512 * 2**20, 2 * nbytes) // 4
    src = torch.empty(arena, dtype=torch.float32).fill_(1.0)
    dst = torch.empty(arena, dtype=torch.float32).fill_(0.0)
    n = nbytes // 4
    windows = [(i * n) % (arena - n) for i in range(reps + 1)]
    times = []
    for i, off in enumerate(windows):
        dt = _timed(lambda: dst[off:off + n].copy_(src[off:off + n]))
        if i:
            times.append(dt)
    return nbytes / statistics.median(times) / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cuda_copy_gbps(nbytes: int, reps: int = 7) -> float:
    """Median device-to-device copy of `nbytes` in this process (cudaMemcpy through torch), timed
    with CUDA events; each rep copies another window of buffers larger than L2 (no cache hits)."""
    arena = max(512 * 2**20, 2 * nbytes)
    src = torch.empty(arena, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.zeros(arena, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(reps + 1):
        off = (i * nbytes) % (arena - nbytes + 1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst[off:off + nbytes].copy_(src[off:off + nbytes])
        b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def copy_gbps(nbytes: int, device: str) -> tuple[float, float]:
    """The copy arm, (from memory another process wrote, cache-hot). On CUDA one figure serves both:
    its windows move every rep, and a pull's bytes are in the peer's VRAM, not in this L2."""
    if device.startswith("cuda"):
        gbps = cuda_copy_gbps(nbytes)
        return gbps, gbps
    return memcpy_gbps(nbytes, cold=True), memcpy_gbps(nbytes)


def bench_engines(model_dir: str, lengths: list[int], store: Path, reps: int, threads: int, device: str = "cpu",
                  dtype: str = "auto", telemetry: bool = True) -> list[dict]:
    max_len = max(lengths)
    blocks = (max_len // 16 + 2) * 2
    kw = dict(num_blocks=blocks, max_num_batched_tokens=1024, max_model_len=max_len + 8, device=device, dtype=dtype)
    prefill = PrefillProcess(model_dir, store, engine_id=f"bench-prefill-{threads}", nixl_threads=threads, **kw)
    engine = LLMEngine.from_model(model_dir, **kw)
    transport = MeasuredTransport(f"bench-decode-{threads}", engine.kv_cache, engine_layout(engine),
                                  FileMetadataStore(store), telemetry=telemetry, num_threads=threads)
    decode = DecodeEngine(engine, transport, transfer_timeout_s=10)  # < the 30 s lease: pulled, not recomputed
    sp = SamplingParams(max_tokens=1 + 1, temperature=0, ignore_eos=True)
    rows = []
    try:
        _pull_once(prefill, decode, [1] * 64, sp, "warm")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for n in lengths:
            samples, prefill_s, phases = [], [], []
            for r in range(reps):
                prompt = [(n * 31 + r * 7 + i * 13) % 250 for i in range(n)]  # fresh each rep: no cache hits
                dt_pull, dt_prefill, nbytes, nblocks, ndesc = _pull_once(prefill, decode, prompt, sp, f"{n}-{r}")
                samples.append(dt_pull)
                prefill_s.append(dt_prefill)
                phases.append(transport.stats.last_pull_phases)
            pull = statistics.median(samples)
            if TRACE is not None:
                turns = TRACE["turn"][-reps:]
                print(f"trace {n} tokens: first loop turn after submit: service {statistics.median(t[0] for t in turns) * 1e3:.3f} ms, "
                      f"step {statistics.median(t[1] for t in turns) * 1e3:.3f} ms"
                      + (f"; READ polled back to back: done {statistics.median(TRACE['tight_s'][-reps:]) * 1e3:.3f} ms "
                         f"after the pull started" if TRACE["tight"] else ""), flush=True)
            cold, hot = copy_gbps(nbytes, device)
            rows.append({"tokens": n, "bytes": nbytes, "blocks": nblocks,
                         "descriptors": ndesc if telemetry else float("nan"),  # NIXL counts them with telemetry on
                         "pull_ms": pull * 1e3, "nixl_gbps": nbytes / pull / 1e9, "memcpy_gbps": cold,
                         "memcpy_hot_gbps": hot, "ratio": nbytes / pull / 1e9 / cold,
                         "prefill_ms": statistics.median(prefill_s) * 1e3,
                         # where the pull's time went: posting the READ, until the loop's first poll, polls
                         "post_ms": statistics.median(p[0] for p in phases) * 1e3,
                         "first_poll_ms": statistics.median(p[1] for p in phases) * 1e3,
                         "polls": statistics.median(p[2] for p in phases)})
        cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        for r in rows:
            r["cpu_per_wall"] = cpu  # this process (decode engine + load), over the whole engine arm
    finally:
        transport.close()
        prefill.close()
    return rows


TRACE: dict | None = None  # --trace: {"tight": bool, "tight_s": [...], "turn": [(service s, step s), ...]}


def _pull_once(prefill, decode, prompt, sp, rid):
    decode.engine.reset_prefix_cache()  # pull every block: nothing reused
    t = time.perf_counter()
    res = prefill.prefill(rid, prompt, sp)
    dt_prefill = time.perf_counter() - t
    st = decode.transport.stats
    before = (st.pulls_ok, st.bytes_pulled, st.blocks_pulled, st.descriptors_used)
    decode.submit(rid, prompt, sp, res.handle)
    if TRACE is not None:
        pull = decode._imports[rid].pull
        if TRACE["tight"]:  # the least a pull takes: its READ's state polled back to back, nothing between
            while decode.transport.agent.check_xfer_state(pull.handle) != "DONE":
                pass
            TRACE["tight_s"].append(time.monotonic() - pull.started)
        t0 = time.perf_counter()
        decode.service()
        t1 = time.perf_counter()
        decode.step()
        TRACE["turn"].append((t1 - t0, time.perf_counter() - t1))  # the loop's first turn: service, step
    while decode.has_unfinished():  # as the engine loop turns: service (lease notices out), step
        decode.service()
        decode.step()
    decode.service()
    assert st.pulls_ok == before[0] + 1, "the pull did not complete"
    return (st.last_pull_s, dt_prefill, st.bytes_pulled - before[1], st.blocks_pulled - before[2],
            st.descriptors_used - before[3])


def _bulk_peer(conn, nbytes: int, threads: int, device: str):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"bulk-src-{nbytes}", nixl_agent_config(backends=["UCX"], num_threads=threads,
                                                              enable_prog_thread=False))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(3.0)
    agent.register_memory(src)
    conn.send((agent.get_agent_metadata(), src.data_ptr()))
    while not conn.poll(0.01):  # until told to exit; progress meanwhile, as a prefill's loop would
        agent.get_new_notifs()
    conn.recv()


class BulkReads:
    """A region of `nbytes` registered in a child process and in this one: times bare NIXL READs
    of its first n bytes as one descriptor (the transport's own cost, no engine around it)."""

    def __init__(self, nbytes: int, threads: int, device: str = "cpu"):
        from nixl._api import nixl_agent, nixl_agent_config

        if device.startswith("cuda"):
            enable_cuda_ipc_reads()  # as NixlTransport does for a VRAM pool (the child inherits it)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_bulk_peer, args=(child, nbytes, threads, device), daemon=True)
        self.proc.start()
        md, self.remote_addr = self.conn.recv()
        self.agent = nixl_agent(f"bulk-dst-{threads}-{nbytes}", nixl_agent_config(
            backends=["UCX"], num_threads=threads, enable_prog_thread=False))
        self.dst = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        self.agent.register_memory(self.dst)
        self.name = self.agent.add_remote_agent(md)
        self.mem, self.dev = ("VRAM", self.dst.device.index or 0) if self.dst.is_cuda else ("DRAM", 0)

    def seconds(self, n: int, reps: int, cold: bool = False) -> float:
        """Median over `reps` READs of n bytes (after one that sets up the connection). cold: this
        process writes 64 MiB before each READ (more than L3), evicting its code and data from the
        CPU caches as a model step does before an engine pull on a CPU; only the READ is timed."""
        evict = torch.empty(16 * 2**20, dtype=torch.float32) if cold else None
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.dst.data_ptr(), n, self.dev)], self.mem)
        remote = self.agent.prep_xfer_dlist(self.name, [(self.remote_addr, n, self.dev)], self.mem)
        self.dst.fill_(0.0)
        times = []
        for i in range(reps + 1):
            if evict is not None:
                evict.fill_(float(i))
            t = time.perf_counter()
            h = self.agent.make_prepped_xfer("READ", local, [0], remote, [0])
            state = self.agent.transfer(h)
            while state != "DONE":
                state = self.agent.check_xfer_state(h)
                assert state != "ERR"
            dt = time.perf_counter() - t
            self.agent.release_xfer_handle(h)
            if i:
                times.append(dt)
        assert bool((self.dst[:n // 4] == 3.0).all()), "bulk READ moved the wrong bytes"
        self.agent.release_dlist_handle(local)
        self.agent.release_dlist_handle(remote)
        return statistics.median(times)

    def close(self) -> None:
        self.conn.send("exit")
        self.proc.join(10)


def bench_bulk(nbytes: int, reps: int, threads: int, device: str = "cpu") -> dict:
    # The copy arm first, before any agent exists (a NIXL progress thread, were one on, would
    # busy-poll the cores a CPU copy needs: beside two, a 4 MiB memcpy read 0.5 GB/s).
    copy = cuda_copy_gbps(nbytes) if device.startswith("cuda") else memcpy_gbps(nbytes)
    bulk = BulkReads(nbytes, threads, device)
    try:
        nixl = nbytes / bulk.seconds(nbytes, reps) / 1e9
    finally:
        bulk.close()
    return {"bytes": nbytes, "nixl_gbps": nixl, "memcpy_gbps": copy, "ratio": nixl / copy}


def add_bulk_arm(rows: list[dict], reps: int, threads: int, device: str) -> None:
    """The same bytes as each engine pull, READ bare; the pull's fixed cost is the difference."""
    bulk = BulkReads(max(r["bytes"] for r in rows), threads, device)
    try:
        for r in rows:
            r["bulk_ms"] = bulk.seconds(r["bytes"], reps) * 1e3
            r["bulk_cold_ms"] = bulk.seconds(r["bytes"], reps, cold=True) * 1e3
            r["fixed_ms"] = r["pull_ms"] - r["bulk_ms"]
    finally:
        bulk.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".bench/llama-50m")
    ap.add_argument("--model", default=None, help="instead of --model-dir: a named random shape "
                    "(cluster/tools/bench/ttft_tpot.py SHAPES), written once under ~/.cache/pdserve/bench-shapes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--bulk-mib", type=int, nargs="*", default=[256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nixl-threads", type=int, nargs="+", default=[0],
                    help="UCX backend progress threads (0 = NIXL's default); one run per value")
    ap.add_argument("--no-telemetry", action="store_true",
                    help="the decode agent without NIXL's telemetry, as serving runs it (no descriptor count)")
    ap.add_argument("--trace", choices=["loop", "tight"], default=None,
                    help="time the decode loop's first turn after each submit (loop), and before it poll the "
                         "READ back to back until done (tight: the least a pull can take)")
    args = ap.parse_args(argv)
    global TRACE
    if args.trace:
        TRACE = {"tight": args.trace == "tight", "tight_s": [], "turn": []}
    if args.model:
        d = model_dir(args.model, Path.home() / ".cache" / "pdserve" / "bench-shapes", args.dtype)
    else:
        d = ensure_bench_model(args.model_dir, max(args.lengths) + 8)
    print(f"UCX transports available: {', '.join(available_transports())}; torch threads {torch.get_num_threads()}")
    for threads in args.nixl_threads:
        load0 = os.getloadavg()
        with tempfile.TemporaryDirectory() as store:
            rows = bench_engines(str(d), args.lengths, Path(store), args.reps, threads, args.device, args.dtype,
                                 telemetry=not args.no_telemetry)
        add_bulk_arm(rows, args.reps, threads, args.device)
        load1 = os.getloadavg()
        print(f"\nNIXL num_threads={threads}")
        print(f"{'tokens':>6} {'MiB':>7} {'blocks':>6} {'desc/blk':>8} {'pull ms':>8} {'NIXL GB/s':>9} "
              f"{'copy GB/s':>11} {'ratio':>6} {'hot memcpy':>10} {'prefill ms':>10} "
              f"{'bulk ms':>8} {'fixed ms':>8} {'pull/bulk':>9} {'cold bulk ms':>12} "
              f"{'post ms':>7} {'to 1st poll ms':>13} {'polls':>5}")
        for r in rows:
            print(f"{r['tokens']:>6} {r['bytes'] / 2**20:>7.2f} {r['blocks']:>6} "
                  f"{r['descriptors'] / r['blocks']:>8.2f} {r['pull_ms']:>8.3f} {r['nixl_gbps']:>9.2f} "
                  f"{r['memcpy_gbps']:>11.2f} {r['ratio']:>6.2f} {r['memcpy_hot_gbps']:>10.2f} "
                  f"{r['prefill_ms']:>10.1f} {r['bulk_ms']:>8.3f} {r['fixed_ms']:>8.3f} "
                  f"{r['pull_ms'] / r['bulk_ms']:>9.2f} {r['bulk_cold_ms']:>12.3f} "
                  f"{r['post_ms']:>7.3f} {r['first_poll_ms']:>13.3f} {r['polls']:>5.0f}")
        print(f"pull: engine pull, median of {args.reps}; bulk: a bare NIXL READ of the same bytes (one "
              f"descriptor), median of {args.reps}; fixed = pull - bulk; cold bulk: the same READ after "
              f"evicting this process's caches (64 MiB written); post: the pull's make_prepped_xfer + "
              f"transfer(); to 1st poll: posted -> the decode loop's first poll; polls: until DONE "
              f"(medians). This process: "
              f"{rows[0]['cpu_per_wall']:.2f} CPU s per wall s over the engine arm; load average "
              f"{load0[0]:.2f} before, {load1[0]:.2f} after", flush=True)
        for mib in args.bulk_mib:  # 256 MiB on a CPU: cache plays no part
            b = bench_bulk(mib * 2**20, args.reps, threads, args.device)
            print(f"bulk {mib} MiB, one descriptor: NIXL {b['nixl_gbps']:.2f} GB/s, "
                  f"{'cudaMemcpy' if args.device.startswith('cuda') else 'memcpy'} {b['memcpy_gbps']:.2f} GB/s, "
                  f"ratio {b['ratio']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
