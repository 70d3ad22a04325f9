"""A message of 5,000,000 prompt ids refused by the ingress's own gRPC server, in this process (a
front door over no pools, a random tiny model), against a floor server that parses each message and
refuses it (cluster.tools.bench.big_messages' floor). Alternating, one call of each at a time on
open channels; the first round warms both and is not counted.

    PYTHONPATH=<worktree> python -m cluster.tools.bench.big_ids [--repeats 15]

Run it from two worktrees to compare their code (docs/benchmarks.md, issue 52)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import grpc

from cluster.config import AppConfig
from cluster.engine.model.init_model import init_model
from cluster.tools.bench.big_messages import start_floor
from cluster.tools.netutil import free_port
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.ingress.api.grpc_server import GrpcServer
from router.ingress.gateway.front_door import FrontDoor

KEY = "sk-bench"
OPTIONS = [("grpc.max_send_message_length", 64 * 2**20)]


async def measure(cfg: AppConfig, floor_port: int, repeats: int) -> dict[str, list[float]]:
    door = FrontDoor.build(cfg, {v.config.serving_group: (None, None) for v in cfg.served_versions()})
    server = GrpcServer(door, cfg)
    await server.start()
    message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 5_000_000))
    times: dict[str, list[float]] = {"pdserve": [], "floor": []}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}", options=OPTIONS) as a, \
                grpc.aio.insecure_channel(f"127.0.0.1:{floor_port}", options=OPTIONS) as b:
            stubs = {"pdserve": pb_grpc.GenerationStub(a), "floor": pb_grpc.GenerationStub(b)}
            for i in range(repeats + 1):
                for name, stub in stubs.items():
                    started = time.perf_counter()
                    try:
                        async for _ in stub.Generate(message, metadata=(("authorization", f"Bearer {KEY}"),),
                                                     timeout=30):
                            pass
                    except grpc.aio.AioRpcError as e:
                        if i == 1 and name == "pdserve":
                            print(f"pdserve: {e.code().name}: {e.details()}")
                    if i:
                        times[name].append(time.perf_counter() - started)
    finally:
        await server.stop(0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model = str(init_model(tempfile.mkdtemp(), layers=2, hidden=64, heads=4, kv_heads=2, vocab=320,
                           max_positions=512, seed=0))
    cfg = AppConfig(model=model, grpc_port=free_port(), api_keys=[KEY])
    times = asyncio.run(measure(cfg, start_floor(), args.repeats))
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, worst {max(ts) * 1e3:.1f} ms ({len(ts)} calls)")
    print(f"pdserve / floor (medians): {statistics.median(times['pdserve']) / statistics.median(times['floor']):.2f}")


if __name__ == "__main__":
    main()
