"""The front door's floor: what a bare Python gRPC server costs a request and a message here.

    python -m cluster.tools.bench.grpc_floor [--arms edge grpc socket] [--tokens 1 64] [--step-ms MS ...]
                                            [--clients 16] [--seconds 8]

Issue 50 asks 1 ms of ingress CPU a request and 0.15 ms a relayed message. This measures what
grpcio's asyncio server costs on this machine with nothing of pdserve in it, so the front door's
figures (front_door --served) can be read against a floor. Each arm starts a server process
(uvloop, grpcio's asyncio server, pdserve's own Generate proto) and, for the relay arms, an
upstream process standing in for a decode replica, on this machine:
  edge    Generate answers from memory: max_tokens token ids, two a response, the last response
          with its finish reason (the transport alone: no call behind it)
  grpc    Generate makes one streaming gRPC call to the upstream (a grpcio asyncio server whose
          method yields the same chunks as msgpack frames) and relays each as a response: a front
          door whose one hop is a gRPC stream, as Serve's channel to a replica is
  socket  the same relay over one persistent Unix socket to the upstream, length-prefixed msgpack
          frames multiplexed by call id (router/channel.py's framing): a front door whose hop is a
          socket of its own
`--busy N`: N processes spin while each arm runs, the cores the engines take beside the real
front door (its figures are taken with both engines on the same two cores).
`--step-ms`: the chunks come at an engine's pace (every step, each stream in flight its next
chunk), so an arm can run at the rate the real front door serves (its figures move with the rate:
a wake-up serves more events at a higher one); 0 = as fast as they are read.
The load generator is front_door's (`--clients` closed-loop callers, a 64-token prompt). Printed
per arm: requests/s, the server's and the upstream's CPU a request (psutil: every thread,
gRPC's C++ ones included) and the server's context switches a request, the server's CPU a
further message ((CPU a request at the larger --tokens - at the first) / the extra responses),
and the load generator's own cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import msgpack

from router.channel import FrameReader as _Frames
from router.channel import frame as _frame


def _chunks(max_tokens: int) -> list[list]:
    """What the upstream streams for `max_tokens`: chunks of two token ids (the last may hold
    one), the last one finished, as a decode replica streaming two tokens a message."""
    n = max(1, max_tokens)
    return [[[7, 8][:n - i], i + 2 >= n] for i in range(0, n, 2)]


class _Ticker:
    """An engine's steps: every `step_s` each stream in flight gets its next chunk, all at once,
    as a decode engine's batch does (0: no pacing, chunks as fast as they are read)."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self._next: asyncio.Future | None = None

    async def tick(self) -> None:
        if not self.step_s:
            return
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._run())
        await asyncio.shield(self._next)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            done, self._next = self._next, asyncio.get_running_loop().create_future()
            done.set_result(None)


async def _paced(max_tokens: int, ticker: "_Ticker"):
    for chunk in _chunks(max_tokens):
        await ticker.tick()
        yield chunk


# ---- the upstream (a decode replica's stand-in) ----

async def _upstream_grpc(port: int, step_s: float) -> None:
    import grpc

    ticker = _Ticker(step_s)

    async def stream(request: bytes, context):
        async for chunk in _paced(msgpack.unpackb(request), ticker):
            yield msgpack.packb(chunk)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Upstream", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _upstream_socket(path: str, step_s: float) -> None:
    ticker = _Ticker(step_s)

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.frames = transport, _Frames()

        def data_received(self, data):
            for call_id, max_tokens in self.frames.feed(data):
                if step_s:
                    asyncio.get_running_loop().create_task(self.send(call_id, max_tokens))
                else:
                    self.transport.write(b"".join(_frame([call_id, *c]) for c in _chunks(max_tokens)))

        async def send(self, call_id: int, max_tokens: int) -> None:
            async for c in _paced(max_tokens, ticker):
                self.transport.write(_frame([call_id, *c]))

    server = await asyncio.get_running_loop().create_unix_server(Proto, path)
    await server.serve_forever()


# ---- the server under test ----

class _SocketHop:
    """One persistent Unix socket to the upstream; calls multiplexed by id, each a queue of chunks."""

    def __init__(self):
        self.calls: dict[int, asyncio.Queue] = {}
        self.next_id = 0

    async def connect(self, path: str) -> None:
        hop = self

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                self.frames = _Frames()

            def data_received(self, data):
                for call_id, ids, last in self.frames.feed(data):
                    hop.calls[call_id].put_nowait((ids, last))

        self.transport, _ = await asyncio.get_running_loop().create_unix_connection(Proto, path)

    async def stream(self, max_tokens: int):
        self.next_id += 1
        call_id, q = self.next_id, asyncio.Queue()
        self.calls[call_id] = q
        self.transport.write(_frame([call_id, max_tokens]))
        try:
            while True:
                ids, last = await q.get()
                yield ids, last
                if last:
                    return
        finally:
            del self.calls[call_id]


async def _server(arm: str, port: int, upstream: str, step_s: float) -> None:
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    if arm == "grpc":
        channel = grpc.aio.insecure_channel(upstream)
        call = channel.unary_stream("/floor.Upstream/Stream")

        async def chunks(max_tokens: int):
            async for raw in call(msgpack.packb(max_tokens)):
                ids, last = msgpack.unpackb(raw)
                yield ids, last
    elif arm == "socket":
        hop = _SocketHop()
        await hop.connect(upstream)
        chunks = hop.stream
    else:
        ticker = _Ticker(step_s)

        def chunks(max_tokens: int):
            return _paced(max_tokens, ticker)

    class Generation(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            async for ids, last in chunks(request.sampling.max_tokens):
                yield pb.GenerateResponse(request_id="r", token_ids=ids,
                                          finish_reason=pb.FINISH_REASON_LENGTH if last else 0)

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Generation(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _run(coro) -> None:
    import uvloop

    uvloop.run(coro)


# ---- the driver ----

def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cluster.tools.bench.grpc_floor", *args])


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:g} s")


def _wait_path(path: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no socket at {path} after {timeout:g} s")
        time.sleep(0.05)


def _spin() -> None:
    while True:
        pass


def arm(name: str, max_tokens: int, step_ms: float, clients: int, seconds: float, busy: int = 0) -> dict:
    """One arm at one output length: its own server (and upstream) processes, at its own step;
    `busy` processes spin meanwhile (the engines' share of the cores, as the real front door has)."""
    from cluster.tools.bench.front_door import _served
    from cluster.tools.netutil import free_port

    procs: dict[str, subprocess.Popen] = {}
    port = free_port()
    upstream = ""
    try:
        if name == "grpc":
            up = free_port()
            procs["upstream"] = _start("--serve-upstream", "grpc", "--port", str(up), "--step-ms", str(step_ms))
            _wait_port(up)
            upstream = f"127.0.0.1:{up}"
        elif name == "socket":
            upstream = f"/tmp/grpc-floor-{os.getpid()}.sock"
            procs["upstream"] = _start("--serve-upstream", "socket", "--path", upstream, "--step-ms", str(step_ms))
            _wait_path(upstream)
        procs["server"] = _start("--serve", name, "--port", str(port), "--upstream", upstream, "--step-ms",
                                 str(step_ms))
        _wait_port(port)
        address = f"127.0.0.1:{port}"
        asyncio.run(_served(address, 4, 1.0, 8, {}))  # warm-up
        pids = {k: p.pid for k, p in procs.items()}
        for i in range(busy):
            procs[f"busy{i}"] = _start("--spin")
        r = asyncio.run(_served(address, clients, seconds, max_tokens, pids))
        r["messages_a_request"] = r["messages"] / max(r["n"], 1)
        r["step_ms"] = step_ms
        return r
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=10)
        if upstream.startswith("/tmp/") and os.path.exists(upstream):
            os.unlink(upstream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=["edge", "grpc", "socket"], choices=["edge", "grpc", "socket"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64],
                    help="each arm's max_tokens, as front_door --served (two a response)")
    ap.add_argument("--step-ms", type=float, nargs="+", default=[0.0],
                    help="the upstream's step, one per --tokens (or one for all): every step each stream gets "
                         "its next response, as a decode engine's batch; 0 = as fast as read")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--busy", type=int, default=0,
                    help="processes that spin while each arm runs: the cores the engines take beside the real "
                         "front door")
    ap.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", choices=["edge", "grpc", "socket"], help=argparse.SUPPRESS)
    ap.add_argument("--serve-upstream", choices=["grpc", "socket"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.spin:
        return _spin()
    step_s = args.step_ms[0] / 1e3
    if args.serve:  # the edge arm paces itself; the relay arms' upstream paces them
        return _run(_server(args.serve, args.port, args.upstream, step_s if args.serve == "edge" else 0.0))
    if args.serve_upstream == "grpc":
        return _run(_upstream_grpc(args.port, step_s))
    if args.serve_upstream == "socket":
        return _run(_upstream_socket(args.path, step_s))
    steps = args.step_ms * len(args.tokens) if len(args.step_ms) == 1 else args.step_ms
    if len(steps) != len(args.tokens):
        ap.error("--step-ms: one value, or one per --tokens")

    print(f"grpc floor: {args.clients} closed-loop callers for {args.seconds:g} s per arm and output length "
          f"({os.cpu_count()} CPUs; {args.busy} spinning processes beside)")
    for name in args.arms:
        rs = [arm(name, t, step_ms, args.clients, args.seconds, args.busy) for t, step_ms in zip(args.tokens, steps)]
        first = None
        for r in rs:
            n = max(r["n"], 1)
            ms = {k: c / r["rps"] * 1e3 if r["rps"] else float("nan") for k, c in r["cores"].items()}
            line = (f"  {name:<6} {r['messages_a_request']:4.1f} messages, step {r['step_ms']:g} ms: "
                    f"{r['rps']:7.1f} req/s ({r['messages_per_s']:.0f} messages/s); "
                    f"server {r['cores']['server']:.2f} cores = "
                    f"{ms['server']:.3f} ms a request")
            if "upstream" in ms:
                line += f"; upstream {ms['upstream']:.3f} ms a request"
            if first is not None and r["messages_a_request"] > first[0]:
                extra = r["messages_a_request"] - first[0]
                line += f"; a further message: server {(ms['server'] - first[1]) / extra:.4f} ms"
            line += f"; server context switches {r['switches']['server'] / n:.1f} a request"
            line += f"; load generator {r['client_cores']:.2f} cores; errors {r['errors'] or 0}; n {n}"
            if r["client_cores"] > 0.9:
                line += " (the load generator used a whole core: it, not the server, may bound the rate)"
            print(line, flush=True)
            if first is None:
                first = (r["messages_a_request"], ms["server"])


if __name__ == "__main__":
    main()
