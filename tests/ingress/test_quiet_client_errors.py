"""The ingress's log filter: Serve logs a traceback for every gRPC request that ends in an
exception; a refusal for the client's own fault must not become one (under a flood of refusals,
formatting them halved the refusal rate: docs/benchmarks.md, issue 38's figures)."""

import logging
import sys

import grpc
import pytest
from ray.serve.exceptions import gRPCStatusError

from router.ingress.api.grpc_api import GrpcAbort
from router.ingress.deployment import _QuietClientErrors
from router.ingress.status import Code


def record(err: BaseException) -> logging.LogRecord:
    try:
        raise err
    except BaseException:  # noqa: BLE001
        return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", None, sys.exc_info())


@pytest.mark.parametrize("code, logged", [
    (Code.RESOURCE_EXHAUSTED, False), (Code.UNAUTHENTICATED, False), (Code.INVALID_ARGUMENT, False),
    (Code.PERMISSION_DENIED, False), (Code.INTERNAL, True), (Code.UNAVAILABLE, True), (Code.ABORTED, True),
])
def test_client_fault_refusals_are_not_logged_as_serve_wraps_them(code, logged):
    abort = GrpcAbort("details", code)
    wrapped = gRPCStatusError(abort, getattr(grpc.StatusCode, code.grpc_name), "details")  # what Serve logs
    assert _QuietClientErrors().filter(record(wrapped)) is logged
    assert _QuietClientErrors().filter(record(abort)) is logged  # and the exception itself, in this process
    assert _QuietClientErrors().filter(logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "ok", None, None))
