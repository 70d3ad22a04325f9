"""A prefill engine in a child OS process, driven over a pipe: for tests and benchmarks on one machine."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict


def prefill_worker(conn, model_dir: str, store_dir: str, engine_id: str, lease_s: float, engine_kwargs: dict,
                   nixl_threads: int = 0, release_grace_s: float = 2.0):
    from cluster.engine.llm_engine import LLMEngine
    from kv_transfer.layout import engine_layout
    from kv_transfer.metadata_store import FileMetadataStore
    from kv_transfer.transport import NixlTransport
    from prefill.engine import PrefillEngine

    engine = LLMEngine.from_model(model_dir, **engine_kwargs)
    transport = NixlTransport(engine_id, engine.kv_cache, engine_layout(engine), FileMetadataStore(store_dir),
                              num_threads=nixl_threads, host_cache=engine.host_arena())
    pe = PrefillEngine(engine, transport, lease_s=lease_s, release_grace_s=release_grace_s)
    conn.send(("ready", transport.incarnation))
    while True:
        if conn.poll(0.002):
            cmd, *args = conn.recv()
            if cmd == "prefill":
                conn.send(pe.prefill(*args))
            elif cmd == "stats":
                engine.check_invariants()
                load = engine.load()
                conn.send({"free": load.free_blocks, "total": load.total_blocks, "leases": pe.num_leases,
                           "quarantined": load.quarantined_blocks, "in_grace": pe.num_in_grace,
                           "host_pinned": engine.kv.host.num_pinned if engine.kv.host is not None else 0,
                           **asdict(transport.stats)})
            elif cmd == "abort":  # the ingress's early release of one lease
                conn.send(pe.abort(*args))
            elif cmd == "release":  # stop holding everything (benchmarks between rounds)
                pe.release_all()
                conn.send(engine.load().free_blocks)
            elif cmd == "exit":
                transport.close()
                conn.send("bye")
                return
        pe.service_leases()


class PrefillProcess:
    def __init__(self, model_dir, store_dir, engine_id="prefill-0", lease_s=30.0, nixl_threads=0,
                 release_grace_s=2.0, **engine_kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_worker, daemon=True,
                                args=(child, model_dir, str(store_dir), engine_id, lease_s, engine_kwargs, nixl_threads,
                                      release_grace_s))
        self.proc.start()
        msg = self._recv(120)
        assert msg[0] == "ready", msg
        self.incarnation = msg[1]

    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"prefill process exited with code {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill process did not answer in {timeout}s")
        return self.conn.recv()

    def call(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        return self._recv(timeout)

    def prefill(self, request_id, prompt, sampling):
        return self.call("prefill", request_id, prompt, sampling)

    def abort(self, request_id):
        return self.call("abort", request_id)

    def stats(self):
        return self.call("stats")

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            self.call("exit")
            self.proc.join(10)
