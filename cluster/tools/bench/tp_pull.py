"""What one pull between tensor-parallel degrees costs the decode group: P tp=1 -> D tp=2 on this
machine's CPU, real NIXL (UCX) and gloo between local processes.

    python -m cluster.tools.bench.tp_pull [--layers 80] [--blocks 256] [--pulls 3]

The prefill engine runs in a child process and computes one prompt of --blocks full blocks; the
decode engine is rank 0 in this process with its worker spawned. Each pull reads the prompt's
blocks into the decode pool (start_pull, then poll in a loop as the decode loop would). Reported
per pull: the object collectives rank 0 issued (broadcasts and gathers, by message) and the bytes
its KV broadcasts carried (pickled, counted by a shim around torch.distributed in this process),
the polls, and the wall time from start_pull to done (separate rounds without the shim). The model
is a random Llama with 2 KV heads, so each decode rank reads one head: L x 2 x bs descriptors a
block, as at tp=2 of a 70B-shaped model. Uses only APIs main had before issue 52's change, so the
same file measures both (run it with the older tree first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
import time
from collections import Counter

import torch.distributed as dist

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.launch import tensor_parallel_engine
from cluster.engine.model.init_model import init_model
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.local_peer import PrefillProcess
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.rank_reads import RankKV
from kv_transfer.transport import NixlTransport

BLOCK = 16


class Shim:
    """Counts rank 0's object broadcasts and gathers by message, and the pickled bytes of KV ones."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes = 0
        self._last = ""
        self._orig = dist.broadcast_object_list, dist.gather_object

    def install(self) -> None:
        broadcast, gather = self._orig

        def counted_broadcast(objects, src=0, **kw):
            self._last = type(objects[0]).__name__
            self.calls["broadcast " + self._last] += 1
            if self._last.startswith("KV"):
                self.bytes += len(pickle.dumps(objects))
            return broadcast(objects, src=src, **kw)

        def counted_gather(obj, out=None, dst=0, **kw):
            self.calls["gather " + self._last] += 1
            return gather(obj, out, dst=dst, **kw)

        dist.broadcast_object_list, dist.gather_object = counted_broadcast, counted_gather

    def remove(self) -> None:
        dist.broadcast_object_list, dist.gather_object = self._orig


def one_pull(transport: NixlTransport, handle, n: int) -> tuple[float, int]:
    started = time.perf_counter()
    pull = transport.start_pull(handle, list(handle.block_ids), list(range(n)), timeout_s=300)
    polls = 1
    while not transport.poll(pull):
        polls += 1
    return time.perf_counter() - started, polls


def run(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="tp-pull-")
    model = str(init_model(f"{tmp}/model", layers=args.layers, hidden=64, heads=4, kv_heads=2, vocab=320,
                           max_positions=args.blocks * BLOCK + 64, seed=3))
    num_blocks = args.blocks + 8
    prefill = PrefillProcess(model, tmp, engine_id="prefill-tp1", num_blocks=num_blocks, lease_s=600)
    try:
        prompt = [(7 * i + 3) % 300 for i in range(args.blocks * BLOCK)]
        res = prefill.prefill("p0", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        handle = res.handle
        config = EngineConfig(model=model, tensor_parallel_size=2, num_blocks=num_blocks)
        with tensor_parallel_engine(config, extension=RankKV()) as (engine, _):
            transport = NixlTransport("decode-tp2", engine.kv_cache, engine_layout(engine), FileMetadataStore(tmp),
                                      tensor_parallel=engine.tensor_parallel)
            try:
                one_pull(transport, handle, len(handle.block_ids))  # warm-up: handshake, remote agents loaded
                shim = Shim()
                shim.install()
                polls = []
                try:
                    for _ in range(args.pulls):
                        polls.append(one_pull(transport, handle, len(handle.block_ids))[1])
                finally:
                    shim.remove()
                timed = [one_pull(transport, handle, len(handle.block_ids)) for _ in range(args.pulls)]
                bytes_by_rank = list(transport.mapped.bytes_by_rank)
                block_bytes = transport.block_bytes
            finally:
                transport.close()
    finally:
        prefill.close()
    pulls = args.pulls
    return {
        "layers": args.layers, "blocks": len(handle.block_ids), "pulls": pulls,
        "collectives_per_pull": {k: v / pulls for k, v in sorted(shim.calls.items()) if " KV" in k},
        "kv_broadcast_bytes_per_pull": shim.bytes / pulls,
        "polls_per_pull_counted": statistics.mean(polls),
        "pull_ms_median": 1e3 * statistics.median(t for t, _ in timed),
        "pull_ms_all": [round(1e3 * t, 1) for t, _ in timed],
        "polls_per_pull_timed": statistics.mean(p for _, p in timed),
        "bytes_each_rank_read_ok": bytes_by_rank == [(1 + 2 * pulls) * len(handle.block_ids) * block_bytes] * 2,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--pulls", type=int, default=3)
    print(json.dumps(run(ap.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
