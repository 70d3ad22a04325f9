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


class WrongRoleError(RuntimeError):
    """A replica was called for a role it does not play now (its role flipped after the call was
    routed): it refused the call before starting anything, so the caller may send it elsewhere."""


class WrongReplicaError(RuntimeError):
    """A call that names its replica (`target_replica`) reached another one: Serve's request router
    sends it to any live replica when the named one is gone. A call that must act on one replica
    (a role flip) is refused there before it changes anything, so its caller sees a failure."""


class DrainTimeoutError(TimeoutError):
    """A role flip's drain did not finish in time: the flip was called off, the replica kept its
    role and every request it held."""


class ErrorKind(str, enum.Enum):
    """Whose fault a request the engine ended with finish reason "error" was (`error` says what)."""

    INVALID_INPUT = "invalid_input"  # the request's own numbers: as InvalidRequestError, INVALID_ARGUMENT / 400
    INTERNAL = "internal"  # the server's (a failed step, bad model numerics): INTERNAL / 500
    # the forward of a step holding it raised: it may be what broke it, so it is not retried on
    # another replica (a poison request would fail that one too, or end it under tensor parallelism)
    FORWARD = "forward"
