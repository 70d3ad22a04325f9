"""Errors of a request inside the cluster, by gRPC status code name (the HTTP API maps them too)."""

from __future__ import annotations


class ServingError(Exception):
    """A request failed inside the cluster. `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Rejected(ServingError):
    """Over a quota or overloaded: RESOURCE_EXHAUSTED / 429, with when to retry. `reason` is a
    short fixed word for metrics (capacity, concurrency, requests_per_min, tokens_per_min,
    queue_wait, overloaded)."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "overloaded"):
        super().__init__("RESOURCE_EXHAUSTED", message)
        self.retry_after_s = retry_after_s
        self.reason = reason
