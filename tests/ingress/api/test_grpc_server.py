"""The ingress's own gRPC server, in this process with a front door over no pools: it binds where
the app's host says (not every interface), refuses a message over the cap as it arrives and keeps
serving, and ends a refusal with its code, details and retry-after."""

import asyncio
import concurrent.futures
import functools
import socket
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import AppConfig
from cluster.tools.netutil import free_port
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.engine.outputs import FinishReason, RequestOutput
from router.ingress.api import grpc_events
from router.ingress.api.grpc_server import MAX_UNREAD_RESPONSES, TRANSPORT_CAP_FACTOR, GrpcServer
from router.ingress.status import Code
from tests.helpers import front_door, wait_for

KEY = "sk-grpc-server-test"


def non_loopback_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


def serving(cfg: AppConfig, door=None):
    """Run `body(server)` with the server up on this loop; returns its result."""

    def run(body):
        async def main():
            server = GrpcServer(door or front_door(cfg), cfg)
            await server.start()
            try:
                return await body(server)
            finally:
                await server.stop(0)

        return asyncio.run(main())

    return run


async def list_models(address: str, key: str | None = KEY, timeout: float = 5.0):
    async with grpc.aio.insecure_channel(address) as channel:
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        return await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), metadata=metadata,
                                                                timeout=timeout)


def config(tiny_model, **kw) -> AppConfig:
    return AppConfig(model=tiny_model, grpc_port=free_port(), api_keys=[KEY], **kw)


def refused_generate(port: int, key: str) -> tuple[grpc.StatusCode, str, float]:
    """A Generate call that must be refused: (code, details, seconds it took)."""
    started = time.perf_counter()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            list(pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(text="hi"), metadata=(("authorization", f"Bearer {key}"),), timeout=10))
        except grpc.RpcError as e:
            return e.code(), e.details(), time.perf_counter() - started
    raise AssertionError("the call was served")


def hooked_loop() -> asyncio.AbstractEventLoop:
    """Another event loop, running on a thread of its own and hooked on gRPC's poller before a
    server starts (as Ray's actor loop is in a replica). Stop it with `call_soon_threadsafe(stop)`."""
    other = asyncio.new_event_loop()
    threading.Thread(target=other.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), other).result(timeout=5)
    other.call_soon_threadsafe(grpc_events.bind_this_loop)
    return other


async def watches(sock) -> bool:
    """Whether the running loop watched `sock` (it no longer does: remove_reader)."""
    return asyncio.get_running_loop().remove_reader(sock)


def test_a_loopback_app_is_not_reachable_from_the_network(tiny_model):
    """Bound to 127.0.0.1 (the default host), not to every address: a call to 127.0.0.2 (another
    address of this host's loopback interface, present in any Linux container: 127/8 is all
    loopback) is refused, and so is one to the host's network address where it has one. It used
    to skip itself where the container had no network address. That 127.0.0.2 reaches a socket
    bound to every address is shown first, so the refusal is the bind's."""
    cfg = config(tiny_model)  # host 127.0.0.1, the default
    with socket.create_server(("0.0.0.0", 0)) as wildcard:  # every address: reached via 127.0.0.2
        socket.create_connection(("127.0.0.2", wildcard.getsockname()[1]), timeout=2).close()
    others = ["127.0.0.2"] + [a for a in [non_loopback_address()] if a is not None]

    async def body(server):
        models = await list_models(f"127.0.0.1:{cfg.grpc_port}")
        codes = []
        for other in others:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await list_models(f"{other}:{cfg.grpc_port}", timeout=2.0)
            codes.append(e.value.code())
        return [m.id for m in models.models], codes

    ids, codes = serving(cfg)(body)
    assert ids == [cfg.model_name] and codes == [grpc.StatusCode.UNAVAILABLE] * len(others)


def test_an_oversized_message_is_refused_naming_the_limit_and_the_server_keeps_serving(tiny_model):
    cfg = config(tiny_model, ingress_limits={"grpc_max_receive_bytes": 64 * 1024})
    address = f"127.0.0.1:{cfg.grpc_port}"
    auth = (("authorization", f"Bearer {KEY}"),)

    async def body(server):
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 2**20)]) as channel:
            stub = pb_grpc.GenerationStub(channel)
            errors = []
            # over the limit: read, then refused naming it; over the transport's cap (4x): refused unread
            for text in ("x" * (64 * 1024), "x" * (TRANSPORT_CAP_FACTOR * 64 * 1024)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(text=text), metadata=auth, timeout=5):
                        pass
                errors.append((e.value.code(), e.value.details()))
            models = await stub.ListModels(pb.ListModelsRequest(), metadata=auth, timeout=5)
            return errors, [m.id for m in models.models]

    (over, far_over), ids = serving(cfg)(body)
    assert over == (grpc.StatusCode.INVALID_ARGUMENT,
                    "request: message of 65540 bytes exceeds grpc_max_receive_bytes 65536")
    assert far_over == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"SERVER: Received message larger than max ({4 * 65536 + 4} vs. {4 * 65536})")
    assert ids == [cfg.model_name]


@pytest.mark.parametrize("loops", [1, 2])
def test_a_refusal_ends_with_its_code_details_and_retry_after(tiny_model, loops):
    cfg = AppConfig(model=tiny_model, grpc_port=free_port(), ingress_event_loops=loops,
                    tenants={"acme": {"api_keys": [KEY], "requests_per_min": 1}})

    async def body(server):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            errors = []
            for key in ("sk-wrong", KEY, KEY):  # unknown key; the minute's one request; the second
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(text="hi"), timeout=5,
                                                 metadata=(("authorization", f"Bearer {key}"),)):
                        pass
                errors.append(e.value)
            return errors

    unknown, first, second = serving(cfg)(body)
    assert (unknown.code(), unknown.details()) == (
        grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")
    assert first.code() == grpc.StatusCode.UNAVAILABLE  # admitted; this door has no pools to serve it
    assert second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = dict(second.trailing_metadata())["retry-after"]
    assert second.details() == f"tenant 'acme' is over its requests_per_min quota (1); retry after {retry} s"
    assert 1 <= int(retry) <= 60


def test_health_names_only_its_services(tiny_model):
    cfg = config(tiny_model)

    async def body(server):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health.Check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=5)
            return e.value

    err = serving(cfg)(body)
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "unknown service 'other.Service'")


def test_only_the_transport_loop_reads_grpc_wakeups_and_the_other_loops_still_get_their_events(tiny_model):
    """grpc_events.py: every loop hooked on gRPC's poller (the door's; another one, as Ray's actor
    loop is) stops watching its socket once the server starts, the transport's keeps it; a call
    made on the door's loop (as Serve's handles make theirs) still completes, its events handed over."""
    cfg = config(tiny_model, ingress_event_loops=2)
    other = hooked_loop()

    async def body(server):
        first = await list_models(f"127.0.0.1:{cfg.grpc_port}")
        socks = {id(sock): sock for _, sock in grpc_events.bound_loops()}
        assert len(socks) == 1  # one poller socket for all loops (grpcio 1.85)
        sock = next(iter(socks.values()))
        on_door = await watches(sock)
        on_other = asyncio.run_coroutine_threadsafe(watches(sock), other).result(timeout=5)
        second = await list_models(f"127.0.0.1:{cfg.grpc_port}")
        return server.handed_off_loops, on_door, on_other, [m.id for m in first.models], [m.id for m in second.models]

    try:
        handed_off, on_door, on_other, first, second = serving(cfg)(body)
    finally:
        other.call_soon_threadsafe(other.stop)
    assert handed_off >= 2  # the door's and the other (loops of earlier tests in this process too)
    assert (on_door, on_other) == (False, False)
    assert first == second == [cfg.model_name]


def test_with_one_loop_the_doors_loop_reads_grpc_wakeups_and_another_loops_calls_still_complete(tiny_model):
    """ingress_event_loops 1: the server's loop is the front door's, and it keeps gRPC's poller
    socket; another loop hooked before the server starts (as Ray's actor loop is) stops watching
    it, and a gRPC call made on that loop still completes, its events handed over."""
    cfg = config(tiny_model, ingress_event_loops=1)
    other = hooked_loop()

    async def body(server):
        socks = {id(sock): sock for _, sock in grpc_events.bound_loops()}
        assert len(socks) == 1  # one poller socket for all loops (grpcio 1.85)
        on_other = asyncio.run_coroutine_threadsafe(watches(next(iter(socks.values()))), other).result(timeout=5)
        loop = asyncio.get_running_loop()
        from_other = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            list_models(f"127.0.0.1:{cfg.grpc_port}"), other))  # its events come through this loop
        here = await list_models(f"127.0.0.1:{cfg.grpc_port}")
        return server.handed_off_loops, server.loop is loop, on_other, [m.id for m in from_other.models], \
            [m.id for m in here.models]

    try:
        handed_off, same_loop, on_other, from_other, here = serving(cfg)(body)
    finally:
        other.call_soon_threadsafe(other.stop)
    assert handed_off >= 1 and same_loop  # the other (and loops of earlier tests in this process)
    assert on_other is False
    assert from_other == here == [cfg.model_name]


@pytest.mark.parametrize("loops", [1, 2])
def test_the_calls_run_on_the_front_doors_loop_with_one_loop_and_on_a_transport_thread_with_two(tiny_model, loops):
    """ingress_event_loops 1: no transport thread; a call's work and gRPC's own part of it (the
    interceptor's key check) run on the thread of the loop that started the server. 2: the
    interceptor runs on the transport's thread, the work on the door's."""
    cfg = config(tiny_model, ingress_event_loops=loops)
    door = front_door(cfg)
    seen = {}
    listed, authenticate = door.model_info, door.admission.authenticate
    door.model_info = lambda tenant=None: seen.setdefault("work", threading.current_thread().name) and listed(tenant)
    door.admission.authenticate = lambda header: seen.setdefault(
        "key", threading.current_thread().name) and authenticate(header)

    async def body(server):
        seen["door"] = threading.current_thread().name
        models = await list_models(f"127.0.0.1:{cfg.grpc_port}")
        threads = [t.name for t in threading.enumerate() if t.name == "pdserve-grpc" and t.ident not in before]
        return [m.id for m in models.models], threads, server.loop is asyncio.get_running_loop()

    before = {t.ident for t in threading.enumerate()}  # earlier tests' transports keep their threads
    ids, threads, same_loop = serving(cfg, door)(body)
    assert ids == [cfg.model_name]
    assert seen["work"] == seen["door"]
    if loops == 1:
        assert (threads, same_loop, seen["key"]) == ([], True, seen["door"])
    else:
        assert (threads, same_loop, seen["key"]) == (["pdserve-grpc"], False, "pdserve-grpc")


def test_a_taken_port_fails_the_replica(tiny_model):
    cfg = config(tiny_model)
    import socket

    with socket.socket() as s:  # a listener without SO_REUSEPORT: no one may share its port
        s.bind(("127.0.0.1", cfg.grpc_port))
        s.listen()

        async def body():
            with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{cfg.grpc_port}"):
                await GrpcServer(front_door(cfg), cfg).start()

        asyncio.run(body())


def test_an_overloaded_door_refuses_on_arrival_while_its_loop_is_busy(tiny_model):
    """Shedding: when the front door's capacity refuses all work, the transport's thread refuses a
    call at once, counted on the door's loop later; its own loop may be busy the while."""
    # a fixed bound: `auto` never refuses with one request ahead (the transport's path is tested here)
    cfg = AppConfig(model=tiny_model, grpc_port=free_port(), api_keys=[KEY], admission={"max_queue_wait_s": 0.5},
                    ingress_event_loops=2)
    door = front_door(cfg)
    queue = door.capacity.first_tokens  # 2,000 prompt tokens ahead at 1,000 a second: a 2 s wait
    queue.rate, queue.pending_tokens, queue.pending_requests = 1000.0, 2000, 1
    counted = []
    door.count_refused = lambda error, tenant: counted.append((error.code, tenant))
    call = functools.partial(refused_generate, cfg.grpc_port)

    async def body(server):
        # the door's loop is blocked from here to the await: nothing of the door runs
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # answered while the loop is blocked: refused by the transport's thread. Alone: sent
            # together with the next call, it counted that one "on its way" or not, by who came first
            shed = pool.submit(call, KEY).result(timeout=5)
            # an unknown key: refused by the transport's interceptor too, from its metadata
            unknown = pool.submit(call, "sk-wrong").result(timeout=5)
            return shed, unknown

    shed, unknown = serving(cfg, door)(body)
    assert shed[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "the ingress's queue (2000 prompt tokens of 1 requests ahead and 0 on their way, at 1000.0 "
                        "tokens/s): predicted queue wait 2.00 s exceeds max_queue_wait_s 0.5: overloaded "
                        "(refused on arrival); retry after 2 s")
    assert shed[2] < 1.0
    assert unknown[:2] == (grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")
    assert unknown[2] < 1.0  # it did not wait for the door's loop
    assert counted == [(Code.RESOURCE_EXHAUSTED, "default")]


def test_with_one_loop_an_overloaded_door_refuses_a_call_as_its_first_step_and_counts_it(tiny_model):
    """ingress_event_loops 1: the shedding check and the key check are a call's first steps on the
    front door's loop; the refusals are the same, and each is counted there (call_soon, no thread)."""
    cfg = AppConfig(model=tiny_model, grpc_port=free_port(), api_keys=[KEY], admission={"max_queue_wait_s": 0.5},
                    ingress_event_loops=1)
    door = front_door(cfg)
    queue = door.capacity.first_tokens  # 2,000 prompt tokens ahead at 1,000 a second: a 2 s wait
    queue.rate, queue.pending_tokens, queue.pending_requests = 1000.0, 2000, 1
    counted, refused = [], []
    door.count_refused = lambda error, tenant: counted.append((error.code, tenant, threading.current_thread().name))
    door.refused = lambda error: refused.append((error.code, threading.current_thread().name))

    async def body(server):
        loop = asyncio.get_running_loop()
        shed = await loop.run_in_executor(None, refused_generate, cfg.grpc_port, KEY)
        unknown = await loop.run_in_executor(None, refused_generate, cfg.grpc_port, "sk-wrong")
        return shed, unknown, threading.current_thread().name

    shed, unknown, door_thread = serving(cfg, door)(body)
    assert shed[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "the ingress's queue (2000 prompt tokens of 1 requests ahead and 0 on their way, at 1000.0 "
                        "tokens/s): predicted queue wait 2.00 s exceeds max_queue_wait_s 0.5: overloaded "
                        "(refused on arrival); retry after 2 s")
    assert unknown[:2] == (grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")
    assert counted == [(Code.RESOURCE_EXHAUSTED, "default", door_thread)]
    assert refused == [(Code.UNAUTHENTICATED, door_thread)]


def test_calls_on_their_way_to_the_busy_loop_count_ahead_of_a_new_one(tiny_model):
    """The queue is under the bound (0.4 s of 0.5), but a call let through and not yet on the door's
    loop is ahead: at the mean prompt length it takes the wait to 0.8 s, so the next call is refused
    on arrival, not after waiting for the loop."""
    # a fixed bound: `auto` never refuses with one request ahead (the transport's path is tested here)
    cfg = AppConfig(model=tiny_model, grpc_port=free_port(), api_keys=[KEY], admission={"max_queue_wait_s": 0.5},
                    ingress_event_loops=2)
    door = front_door(cfg)
    queue = door.capacity.first_tokens
    queue.rate, queue.pending_tokens, queue.pending_requests, queue.mean_tokens = 1000.0, 400, 1, 400.0
    door.count_refused = lambda error, tenant: None

    def call(key: str, model: str = "") -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
            try:
                list(pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(text="hi", model=model), metadata=(("authorization", f"Bearer {key}"),), timeout=10))
            except grpc.RpcError as e:
                return e.code(), e.details()
        raise AssertionError("the call was served")

    async def body(server):
        transit = server.generation.transit
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ahead = pool.submit(call, KEY, "nope")  # let through (the door refuses unknown models), then held
            for _ in range(500):  # the door's loop is busy: it stays in transit
                if transit.calls == 1:
                    break
                time.sleep(0.01)
            assert transit.calls == 1
            refused = pool.submit(call, KEY).result(timeout=5)  # while the door's loop is still busy
            assert not ahead.done()
            ahead_result = await asyncio.wrap_future(ahead)
        return refused, ahead_result, transit.calls

    refused, ahead, in_transit = serving(cfg, door)(body)
    assert refused == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "the ingress's queue (400 prompt tokens of 1 requests ahead and 1 on their way, at 1000.0 "
                       "tokens/s): predicted queue wait 0.80 s exceeds max_queue_wait_s 0.5: overloaded "
                       "(refused on arrival); retry after 1 s")
    assert ahead[0] == grpc.StatusCode.NOT_FOUND
    assert in_transit == 0  # its transit ended when its work started


def test_a_bug_in_a_call_is_internal_and_the_server_keeps_serving(tiny_model):
    cfg = config(tiny_model)
    door = front_door(cfg)
    door.model_info = lambda tenant=None: 1 / 0  # a bug in what ListModels reads

    async def body(server):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await list_models(f"127.0.0.1:{cfg.grpc_port}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return e.value, health.status

    err, status = serving(cfg, door)(body)
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, "internal error")
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered: a door over no pools has no decode replica


def test_list_models_lists_a_weight_0_canary_only_to_a_tenant_that_may_pin(tiny_model):
    cfg = AppConfig.model_validate({
        "grpc_port": free_port(),
        "models": {"tiny": {"versions": {"v1": {"model": tiny_model, "weight": 1},
                                         "cand": {"model": tiny_model, "weight": 0}}}},
        "tenants": {"acme": {"api_keys": [KEY]}, "ops": {"api_keys": ["sk-ops"], "pin_versions": True}}})

    async def body(server):
        address = f"127.0.0.1:{cfg.grpc_port}"
        return [[(m.id, list(m.versions), m.version) for m in (await list_models(address, key)).models]
                for key in (KEY, "sk-ops")]

    assert serving(cfg)(body) == [[("tiny", ["v1"], "v1")], [("tiny", ["v1", "cand"], "v1")]]


class PacedDecode:
    """A decode deployment handle whose stream makes a token a millisecond (a fast engine's pace)
    up to max_tokens; counts the tokens made and the streams cancelled."""

    def __init__(self):
        self.made = self.cancelled = 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, rid, ids, sampling, kv_handle, ctx, target_replica=None, generated=()):
        decode, made = self, 0

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                nonlocal made
                await asyncio.sleep(0.001)
                if made == sampling.max_tokens:
                    raise StopAsyncIteration
                made += 1
                decode.made += 1
                last = made == sampling.max_tokens
                return RequestOutput(rid, [5], "", last, FinishReason.LENGTH if last else None, len(ids), made, 0)

            def cancel(self):
                decode.cancelled += 1
        return Stream()


@pytest.mark.parametrize("loops", [1, 2])
def test_a_client_that_stops_reading_is_cut_off_past_the_unread_bound_and_its_request_cancelled(model_factory, loops):
    """A client that reads gets its whole stream. One that reads nothing: gRPC sends what its
    64 KiB window takes (BDP probing off keeps it there), then the responses wait in the call's
    relay; past MAX_UNREAD_RESPONSES the request is cancelled (its decode stream) and the call
    ends RESOURCE_EXHAUSTED naming the limit, which the client reads after what its window holds."""
    reading_tokens, max_tokens = 1_500, 12_000
    model = model_factory("long-context", layers=1, vocab=320, max_positions=16_384)
    cfg = AppConfig(model=model, grpc_port=free_port(), api_keys=[KEY], prefill={"num_replicas": 0},
                    ingress_event_loops=loops)
    decode = PacedDecode()
    door = front_door(cfg, decode=decode)
    auth = (("authorization", f"Bearer {KEY}"),)

    def request(n: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[256, 1, 2, 3]),
                                  sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))

    async def read_all(call) -> int:
        received = 0
        while (response := await call.read()) is not grpc.aio.EOF:
            received += len(response.token_ids)
        return received

    async def body(server):
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.grpc_port}", options=options) as channel:
            stub = pb_grpc.GenerationStub(channel)
            whole = await read_all(stub.Generate(request(reading_tokens), metadata=auth, timeout=60))
            made_before = decode.made
            call = stub.Generate(request(max_tokens), metadata=auth, timeout=60)
            # not reading: the server either gives up on the call or makes every token
            await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(
                lambda: decode.cancelled or decode.made - made_before == max_tokens, "a cancel or every token",
                timeout=30))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await read_all(call)
            return whole, e.value, decode.made - made_before, door.admission.total_inflight

    whole, error, made, inflight = serving(cfg, door)(body)
    assert whole == reading_tokens
    assert (error.code(), error.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the client left {MAX_UNREAD_RESPONSES} responses unread (MAX_UNREAD_RESPONSES {MAX_UNREAD_RESPONSES}): "
        "the request was cancelled")
    assert (decode.cancelled, inflight) == (1, 0)
    # one token a response: the window's ~64 KiB of responses, then the bound, then no more
    assert 1_000 < made - MAX_UNREAD_RESPONSES < max_tokens // 2, made
