"""How a request can fail, in one table: a closed set of codes, each with its gRPC status code,
HTTP status, OpenAI error type, and what kind of end it is. The edges (api/grpc_api.py,
api/openai_api.py), telemetry and the audit map through it; nothing else spells a status."""

from __future__ import annotations

import asyncio
import enum
import math

from cluster.errors import InvalidRequestError


class Code(enum.Enum):
    # refusal: the request was turned away before it ran (metrics count it as rejected, not as a
    # stream). client_fault: the client's own doing; the server logs no traceback for it.
    #                     gRPC name              HTTP  OpenAI error type        refusal client_fault
    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error", True, True)
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error", True, True)
    PERMISSION_DENIED = ("PERMISSION_DENIED", 403, "permission_error", True, True)
    NOT_FOUND = ("NOT_FOUND", 404, "not_found_error", True, True)
    FAILED_PRECONDITION = ("FAILED_PRECONDITION", 422, "invalid_request_error", True, False)
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error", True, True)
    CANCELLED = ("CANCELLED", 499, "cancelled", False, False)
    INTERNAL = ("INTERNAL", 500, "server_error", False, False)
    ABORTED = ("ABORTED", 500, "server_error", False, False)
    UNAVAILABLE = ("UNAVAILABLE", 503, "server_error", False, False)
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout_error", False, True)

    def __init__(self, grpc_name: str, http_status: int, error_type: str, refusal: bool, client_fault: bool):
        self.grpc_name = grpc_name
        self.http_status = http_status
        self.error_type = error_type
        self.refusal = refusal
        self.client_fault = client_fault


REPLICA_FAULTS = frozenset({Code.INTERNAL, Code.UNAVAILABLE, Code.ABORTED})


class ServingError(Exception):
    """A request failed inside the cluster, with its `Code`. `retry_after_s` is set when the
    client may retry later (over a quota, overloaded). `replica_fault`: the serving version's
    replicas failed it (what the rollout gate counts); by default the codes that say so, and also
    a deadline spent waiting for a replica that never took the request."""

    def __init__(self, code: Code | str, message: str, retry_after_s: float | None = None,
                 replica_fault: bool | None = None):
        super().__init__(message)
        self.code = code if isinstance(code, Code) else Code[code]
        self.message = message
        self.retry_after_s = retry_after_s
        self.replica_fault = self.code in REPLICA_FAULTS if replica_fault is None else replica_fault


class Rejected(ServingError):
    """Over a quota or overloaded: RESOURCE_EXHAUSTED / 429, with when to retry. `reason` is a
    short fixed word for metrics (capacity, concurrency, requests_per_min, tokens_per_min,
    queue_wait, overloaded)."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "overloaded"):
        super().__init__(Code.RESOURCE_EXHAUSTED, message, retry_after_s)
        self.reason = reason


def retry_after_seconds(seconds: float) -> int:
    """Whole seconds, at least 1, as HTTP's Retry-After says them."""
    return max(1, math.ceil(seconds))


def code_of(error: BaseException) -> Code:
    """The code a request that ended with `error` gets."""
    if isinstance(error, InvalidRequestError):
        return Code.INVALID_ARGUMENT
    if isinstance(error, ServingError):
        return error.code
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return Code.CANCELLED
    return Code.INTERNAL


def error_code(error: BaseException) -> str:
    """The code's name (what metrics, spans and audit records carry)."""
    return code_of(error).grpc_name
