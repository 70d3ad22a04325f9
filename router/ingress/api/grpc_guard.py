"""What the gRPC transport decides about a call before its message is read or parsed.

- `KeyFirst` (a server interceptor): a call without a valid key ends UNAUTHENTICATED from its
  metadata alone. Its handler is a streaming-request one that never asks for the message, so gRPC
  reads none of it (what HTTP/2's window had already taken in is dropped with the stream). The
  health service needs no key (probes). Before this, a 16 MiB message was read and parsed, and
  only then was its key looked at.
- `sized`: a message over `ingress_limits.grpc_max_receive_bytes` is refused by its length, before
  protobuf parses it (5,000,000 prompt ids were parsed into a list first: the work that grows with
  the message came before the check).
- `Meter`: the bytes the transport handed to a deserializer (what was read), for tests and tools.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import grpc

from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.api.grpc_api import status_of
from router.ingress.status import ServingError

PUBLIC_PREFIXES = ("/grpc.health.v1.Health/",)  # methods a caller without a key may call (probes)
AUTHORIZATION = "authorization"


class Oversized(NamedTuple):
    """A request message refused by its length, unparsed (the handler ends the call INVALID_ARGUMENT)."""

    size: int


class Meter:
    """Messages and bytes the transport read into a deserializer, and the messages parsed (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.messages = 0
        self.bytes = 0
        self.parsed = 0

    def read(self, n: int) -> None:
        with self._lock:
            self.messages += 1
            self.bytes += n


def sized(parse: Callable[[bytes], object], limit: int, meter: Meter) -> Callable[[bytes], object]:
    """`parse`, for a message of at most `limit` bytes; a longer one becomes Oversized, unparsed."""

    def deserialize(raw: bytes):
        meter.read(len(raw))
        if len(raw) > limit:
            return Oversized(len(raw))
        meter.parsed += 1  # the transport's thread only
        return parse(raw)

    return deserialize


def generation_handler(servicer, limit: int, meter: Meter) -> grpc.GenericRpcHandler:
    """`pdserve.v1.Generation` as the generated add_GenerationServicer_to_server registers it, its
    request messages `sized`."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=sized(pb.GenerateRequest.FromString, limit, meter),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=sized(pb.ListModelsRequest.FromString, limit, meter),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler("pdserve.v1.Generation", handlers)


class KeyFirst(grpc.aio.ServerInterceptor):
    """Refuses a call whose key `check` refuses, from its metadata, before its message is read.
    `check(authorization)` returns the refusal (or None: go on); it only reads, on the server's
    loop (the transport's thread with ingress_event_loops 2). `refused(error)` is told of each refusal (to count and audit it on the front door's loop)."""

    def __init__(self, check: Callable[[str | None], ServingError | None], refused: Callable[[ServingError], None]):
        self.check, self.refused = check, refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not details.method.startswith(PUBLIC_PREFIXES):
            header = next((v for k, v in details.invocation_metadata or () if k == AUTHORIZATION), None)
            error = self.check(header if isinstance(header, str) else None)
            if error is not None:
                self.refused(error)
                return _refusal(error)
        return await continuation(details)


def _refusal(error: ServingError) -> grpc.RpcMethodHandler:
    """A handler for any method that ends the call with `error` and never asks for its message."""
    status = status_of(error)

    async def refuse(requests, context: grpc.aio.ServicerContext) -> None:  # `requests` is never read
        await context.abort(status.code, status.details)

    return grpc.stream_stream_rpc_method_handler(refuse)
