"""Auth before bytes, without Ray: a call without a valid key is refused from its metadata or
headers alone (the gRPC server's interceptor, the HTTP app's outermost middleware), so nothing of
its message or body is read; a message over the limit is refused by its length, unparsed; health
calls share one probe; calls past grpc_max_concurrent_rpcs are refused by gRPC."""

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import AppConfig
from cluster.tools.netutil import free_port
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.ingress.api import probes
from router.ingress.api.grpc_server import GrpcServer
from tests.helpers import front_door

KEY = "sk-auth-first"
AUTH = (("authorization", f"Bearer {KEY}"),)
UNKNOWN_KEY = "missing or unknown API key (authorization: Bearer <key>)"
BIG = [("grpc.max_send_message_length", 32 * 2**20)]


async def until(predicate, timeout_s: float, what: str) -> None:
    """Poll `predicate` on this loop (others' work runs meanwhile), at most `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def config(tiny_model, **kw) -> AppConfig:
    return AppConfig(model=tiny_model, grpc_port=free_port(), api_keys=[KEY], **kw)


def serving(cfg: AppConfig, body, liveness=None):
    """`body(server, door)` with the server up on this loop (the front door's)."""
    async def main():
        door = front_door(cfg)
        server = GrpcServer(door, cfg, liveness)
        await server.start()
        try:
            return await body(server, door)
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def generate_error(address: str, request: pb.GenerateRequest, metadata=None) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address, options=BIG) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in pb_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=20):
                pass
        return e.value


def test_an_unauthenticated_16_mib_message_is_refused_unread(tiny_model):
    cfg = config(tiny_model)  # grpc_max_receive_bytes 4 MiB: the transport takes up to 16 MiB
    big = pb.GenerateRequest(text="a" * (16 * 2**20 - 64))

    async def body(server, door):
        address = f"127.0.0.1:{cfg.grpc_port}"
        refusals = [await generate_error(address, big, (("authorization", f"Bearer {k}"),)) for k in ("sk-wrong",)]
        refusals.append(await generate_error(address, big))  # no key at all
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=5)
        refusals.append(e.value)
        read_unauthenticated = server.meter.bytes
        await until(lambda: door.arrivals == 3, 5, "the refusals counted on the door's loop")
        small = pb.GenerateRequest(text="hi", model="nope")  # read, then refused by the door (no such model)
        not_found = await generate_error(address, small, AUTH)
        return refusals, read_unauthenticated, server.meter.bytes, not_found

    refusals, read_unauthenticated, read_after, not_found = serving(cfg, body)
    assert big.ByteSize() > 16 * 2**20 - 64
    assert [(e.code(), e.details()) for e in refusals] == [(grpc.StatusCode.UNAUTHENTICATED, UNKNOWN_KEY)] * 3
    assert read_unauthenticated == 0  # not one byte of the 16 MiB reached a deserializer
    assert read_after == pb.GenerateRequest(text="hi", model="nope").ByteSize()
    assert not_found.code() == grpc.StatusCode.NOT_FOUND


def test_a_message_of_5m_prompt_ids_is_refused_by_its_length_unparsed(tiny_model):
    cfg = config(tiny_model)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 5_000_000))
    size = request.ByteSize()

    async def body(server, door):
        error = await generate_error(f"127.0.0.1:{cfg.grpc_port}", request, AUTH)
        return error, server.meter.messages, server.meter.bytes, server.meter.parsed

    error, messages, read, parsed = serving(cfg, body)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"request: message of {size} bytes exceeds grpc_max_receive_bytes 4194304")
    assert (messages, read, parsed) == (1, size, 0)  # read once, never parsed into 5,000,000 ints


class GatedProbe:
    """A probe that counts its runs and answers when the test opens it (on the front door's loop)."""

    def __init__(self):
        self.runs = 0
        self.gate = asyncio.Event()

    async def __call__(self) -> bool:
        self.runs += 1
        await self.gate.wait()
        return True


def test_concurrent_health_checks_share_one_probe_and_past_the_rpc_cap_are_refused(tiny_model):
    cfg = config(tiny_model, ingress_limits={"grpc_max_concurrent_rpcs": 8})
    probe = GatedProbe()
    liveness = probes.Liveness(probe, ttl_s=60.0)

    async def body(server, door):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            checks = [asyncio.ensure_future(health.Check(health_pb2.HealthCheckRequest(), timeout=20))
                      for _ in range(8)]
            await until(lambda: probe.runs == 1, 5, "the first probe")
            await asyncio.sleep(0.5)  # the other seven calls reach the server (bounded: they are refused below if not)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # the ninth call at once: over the cap
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            probe.gate.set()
            answers = await asyncio.gather(*checks)
            again = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # within the ttl: no probe
        return e.value, [a.status for a in answers], again.status

    over, answers, again = serving(cfg, body, liveness)
    assert (over.code(), over.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
    assert answers == [health_pb2.HealthCheckResponse.SERVING] * 8
    assert again == health_pb2.HealthCheckResponse.SERVING
    assert (probe.runs, liveness.probes) == (1, 1)


def test_liveness_probes_again_after_its_ttl_and_a_failed_probe_is_not_live():
    now = [0.0]
    answers = iter([True, RuntimeError("controller gone")])

    async def probe():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    liveness = probes.Liveness(probe, ttl_s=1.0, clock=lambda: now[0])

    async def main():
        first = [await liveness.live(), await liveness.live()]
        now[0] = 1.5
        return first, await liveness.live()

    assert asyncio.run(main()) == ([True, True], False)
    assert liveness.probes == 2


# ---- HTTP ----------------------------------------------------------------------------------------

def asgi_counting(app, path: str, chunks: list[bytes], headers=()) -> tuple[int, dict, int]:
    """One request whose body streams in `chunks` (no Content-Length): (status, JSON, chunks the app received)."""
    inbox = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    taken = [0]
    sent = []

    async def receive():
        if inbox:
            taken[0] += 1
            return inbox.pop(0)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    hdrs = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers)]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": hdrs,
             "server": ("test", 80), "client": ("test", 1)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:])), taken[0]


@pytest.fixture()
def keyed_app(tiny_model):
    from router.ingress.api import openai_api

    door = front_door(AppConfig(model=tiny_model, api_keys=[KEY]))
    openai_api.bind(door)
    yield openai_api.app, door
    openai_api.bind(None)


@pytest.mark.parametrize("headers", [(), (("authorization", "Bearer sk-wrong"),)])
def test_an_unauthenticated_4_mib_body_is_401_before_any_of_it_is_received(keyed_app, headers):
    app, door = keyed_app
    body = json.dumps({"prompt": "a" * (4 * 2**20 - 64)}).encode()
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    status, error, taken = asgi_counting(app, "/v1/completions", chunks, headers)
    assert (status, error["error"]["message"], error["error"]["code"]) == (401, UNKNOWN_KEY, "unauthenticated")
    assert taken == 0 and len(chunks) == 64  # not one of the 64 chunks was received
    assert door.arrivals == 1  # counted


def test_an_authenticated_body_is_received_and_served(keyed_app):
    app, _ = keyed_app
    chunks = [b'{"prompt": "hi", "model": ', b'"nope"}']
    status, error, taken = asgi_counting(app, "/v1/completions", chunks, (("authorization", f"Bearer {KEY}"),))
    assert (status, error["error"]["code"], taken) == (404, "model_not_found", 2)


def test_concurrent_http_health_calls_share_one_probe(tiny_model):
    from router.ingress.api import openai_api

    probe = GatedProbe()
    door = front_door(AppConfig(model=tiny_model, api_keys=[KEY]))
    liveness = probes.Liveness(probe, ttl_s=60.0)
    openai_api.bind(door, liveness)
    try:
        async def main():
            calls = [asyncio.ensure_future(openai_api.health()) for _ in range(32)]
            await until(lambda: probe.runs == 1, 5, "the probe")
            probe.gate.set()
            return await asyncio.gather(*calls)

        answers = asyncio.run(main())
    finally:
        openai_api.bind(None)
    assert [a["status"] for a in answers] == ["serving"] * 32
    assert (probe.runs, liveness.probes) == (1, 1)
