"""How a request can fail, in one table: a closed set of codes, each with its gRPC status code,
HTTP status and OpenAI error type. The edges (grpc_api.py, openai_api.py) map through it; nothing
else spells a status."""

from __future__ import annotations

import enum
import math


class Code(enum.Enum):
    #                     gRPC name              HTTP  OpenAI error type
    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    NOT_FOUND = ("NOT_FOUND", 404, "not_found_error")
    FAILED_PRECONDITION = ("FAILED_PRECONDITION", 422, "invalid_request_error")
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    CANCELLED = ("CANCELLED", 499, "cancelled")
    INTERNAL = ("INTERNAL", 500, "server_error")
    ABORTED = ("ABORTED", 500, "server_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "server_error")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout_error")

    def __init__(self, grpc_name: str, http_status: int, error_type: str):
        self.grpc_name = grpc_name
        self.http_status = http_status
        self.error_type = error_type


class ServingError(Exception):
    """A request failed inside the cluster, with its `Code`. `retry_after_s` is set when the
    client may retry later (over a quota, overloaded)."""

    def __init__(self, code: Code | str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code if isinstance(code, Code) else Code[code]
        self.message = message
        self.retry_after_s = retry_after_s


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
