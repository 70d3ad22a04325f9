"""Errors that cross the engine boundary. The ingress maps them to gRPC/HTTP status codes."""

import enum


class InvalidRequestError(ValueError):
    """Bad user input. Names the offending field; maps to INVALID_ARGUMENT / 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFullError(RuntimeError):
    """An engine's waiting queue is at its bound: overload. Maps to RESOURCE_EXHAUSTED / 429."""


class ErrorKind(str, enum.Enum):
    """Whose fault a request the engine ended with finish reason "error" was (`error` says what)."""

    INVALID_INPUT = "invalid_input"  # the request's own numbers: as InvalidRequestError, INVALID_ARGUMENT / 400
    INTERNAL = "internal"  # the server's (a failed step, bad model numerics): INTERNAL / 500
