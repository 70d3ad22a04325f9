"""What a client reads when a decode leg fails on a replica (no Ray running: the handle is a fake
that raises Ray's own exception objects, as a Serve handle does). Ray's text of a remote failure is
the replica's traceback with its pid, host and source paths; the client's message names the
request, the replica and the failure's class (or our own error's message) and nothing of that;
the ingress's log has the whole error."""

import asyncio
import logging

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from cluster.engine.request import RequestContext
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.errors import QueueFullError
from router.ingress.flow.legs import DecodeLegs
from router.ingress.flow.stream import ClientStream
from router.ingress.status import Code, ServingError

REMOTE_TRACEBACK = """Traceback (most recent call last):
  File "/opt/pdserve/cluster/serving/replica.py", line 213, in generate
    raise RuntimeError(f"request {request_id}: failed by fault injection (fail_requests)")
RuntimeError: request rid: failed by fault injection (fail_requests)"""


def remote(cause: BaseException) -> RayTaskError:
    """The exception a Serve handle raises in the caller for `cause` raised on a replica."""
    return RayTaskError("generate", REMOTE_TRACEBACK, cause, proctitle="ray::ServeReplica:pdserve:decode",
                        pid=4242, ip="10.0.0.7").as_instanceof_cause()


class FailingDecode:
    """A decode deployment handle whose every stream raises `error` before its first output."""

    def __init__(self, error: BaseException):
        self.error = error
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        error = self.error

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                raise error

            def cancel(self):
                pass
        return Stream()


def fail(tiny_model, error: BaseException) -> ServingError:
    legs = DecodeLegs(FailingDecode(error), max_migrations=0, prefill=None)
    client = ClientStream("rid", IncrementalDetokenizer(Tokenizer(tiny_model), [1, 2], ()), [1, 2])

    async def run():
        async for _ in legs.stream("rid", [1, 2], None, RequestContext(), None, "d-0", client, "decode"):
            pass

    with pytest.raises(ServingError) as e:
        asyncio.run(run())
    return e.value


@pytest.mark.parametrize("error, code, message", [
    (remote(RuntimeError("request rid: failed by fault injection (fail_requests)")), Code.UNAVAILABLE,
     "decode failed for rid on replica d-0: RuntimeError"),
    (ActorDiedError(cause=RayTaskError("__init__", REMOTE_TRACEBACK, RuntimeError("x"),
                                       proctitle="ray::ServeReplica:pdserve:decode", pid=4242, ip="10.0.0.7")),
     Code.UNAVAILABLE, "decode failed for rid: ActorDiedError"),  # the replica died: no leg is left to migrate to
    (remote(QueueFullError("64 requests are already waiting (max_waiting 64)")), Code.RESOURCE_EXHAUSTED,
     "request rid: 64 requests are already waiting (max_waiting 64)"),  # our own message, written for clients
], ids=["replica-exception", "replica-died", "queue-full"])
def test_a_failed_leg_tells_the_client_its_class_not_the_replicas_traceback(tiny_model, caplog, error, code,
                                                                           message):
    remote_text = str(error)
    assert "pid=4242" in remote_text and "/opt/pdserve/" in remote_text  # what must not reach the client
    with caplog.at_level(logging.WARNING, logger="router.ingress.flow.legs"):
        e = fail(tiny_model, error)
    assert (e.code, e.message) == (code, message)
    for leak in ("Traceback", "pid=", "ip=", "/opt/pdserve/", 'File "', "fail_requests"):
        assert leak not in e.message
    if code is not Code.RESOURCE_EXHAUSTED:  # the whole error stays in the ingress's log
        assert "/opt/pdserve/cluster/serving/replica.py" in caplog.text and "pid=4242" in caplog.text
