"""Refusing large gRPC messages: pdserve as `pdserve up` configures it vs a floor server.

    python -m cluster.tools.bench.big_messages [--repeats 7]

The floor is a bare gRPC server in this process's own thread that reads the whole message and refuses
it at once (no parsing, no checks): what a client pays to send the message and hear "no". pdserve's
arm is the default app (random demo model, 1 prefill + 1 decode replica) over its own gRPC server. Each
message goes to each server `--repeats` times, the two alternating; printed: the status each gets and
the median and worst time, and pdserve's excess over the floor (goal: <= 100 ms for the 5 MB text).

Messages: a 5 MB text prompt (over the 4 MiB cap: refused as it arrives), 100,000 stop strings (under
the cap: parsed, refused by the count), 5,000,000 token ids (over the cap).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import grpc

from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

MESSAGES = {
    "5 MB text": lambda: pb.GenerateRequest(text="a" * 5_000_000),
    "100k stop strings": lambda: pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
        stop=[f"s{i}" for i in range(100_000)])),
    "5M token ids": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 5_000_000)),
}


class _Refuse(pb_grpc.GenerationServicer):
    async def Generate(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        yield  # an async generator, as pdserve's


def start_floor() -> int:
    """The floor server on its own loop and thread; returns its port."""
    ready: dict = {}

    def run():
        loop = asyncio.new_event_loop()

        async def serve():
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)])
            pb_grpc.add_GenerationServicer_to_server(_Refuse(), server)
            ready["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            ready["server"] = server

        loop.run_until_complete(serve())
        ready["event"].set()
        loop.run_forever()

    ready["event"] = threading.Event()
    threading.Thread(target=run, daemon=True).start()
    ready["event"].wait(30)
    return ready["port"]


def timed_refusal(stub, message) -> tuple[str, float]:
    """One call on an open channel (its connection made before): the status and the seconds it took."""
    started = time.perf_counter()
    try:
        list(stub.Generate(message, timeout=60))
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    return code, time.perf_counter() - started


def main() -> None:
    import ray

    import cluster.app.builder as serve_app
    from cluster.config import AppConfig
    from cluster.tools.netutil import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    floor = f"127.0.0.1:{start_floor()}"
    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    cfg = serve_app.ensure_model(default="random", config=AppConfig(http_port=free_port(), grpc_port=free_port()))
    serve_app.start(cfg)
    pdserve = f"127.0.0.1:{cfg.grpc_port}"
    options = [("grpc.max_send_message_length", 64 * 2**20)]
    channels = {arm: grpc.insecure_channel(address, options=options) for arm, address in (("pdserve", pdserve),
                                                                                       ("floor", floor))}
    stubs = {arm: pb_grpc.GenerationStub(c) for arm, c in channels.items()}
    for arm, stub in stubs.items():  # connected before anything is timed
        timed_refusal(stub, pb.GenerateRequest())
    try:
        print(f"\nrefusing large gRPC messages: pdserve defaults ({pdserve}) vs a floor server that refuses "
              f"each message once read; {args.repeats} of each, alternating")
        for name, make in MESSAGES.items():
            message = make()
            times: dict[str, list[float]] = {"pdserve": [], "floor": []}
            codes: dict[str, set[str]] = {"pdserve": set(), "floor": set()}
            for _ in range(args.repeats):
                for arm, stub in stubs.items():
                    code, took = timed_refusal(stub, message)
                    times[arm].append(took)
                    codes[arm].add(code)
            p, f = (statistics.median(times[a]) * 1e3 for a in ("pdserve", "floor"))
            print(f"  {name:<18} ({message.ByteSize() / 1e6:.1f} MB)  pdserve {sorted(codes['pdserve'])} median "
                  f"{p:.1f} ms (worst {max(times['pdserve']) * 1e3:.1f})  floor {sorted(codes['floor'])} median "
                  f"{f:.1f} ms (worst {max(times['floor']) * 1e3:.1f})  excess {p - f:+.1f} ms")
    finally:
        for c in channels.values():
            c.close()
        serve_app.delete_app(cfg)
        ray.shutdown()


if __name__ == "__main__":
    main()
