"""The rollout gate judges a version by what its replicas did (issue 39): a deadline spent waiting
for a replica that never took the request counts against the version, a request always ends even
without a deadline, and TTFT is compared per prompt token."""

import asyncio

import pytest

from cluster.config.models import RolloutOptions
from cluster.engine.request import RequestContext
from router.ingress.flow.legs import DecodeLegs
from router.ingress.flow.stream import ClientStream
from router.ingress.request import Delta
from router.ingress.status import Code, ServingError
from router.ingress.versions.rollout import Recorder, Rollouts, VersionStats


def _outcome(error: ServingError | None) -> VersionStats:
    async def stream():
        yield Delta("r", "a", [1], None, 8, 1)
        if error is not None:
            raise error

    async def consume():
        rec = Recorder()
        try:
            async for _ in rec.observe(("m", "v2"), stream()):
                pass
        except ServingError:
            pass
        return rec.drain()[("m", "v2")]

    return asyncio.run(consume())


@pytest.mark.parametrize("error, errors", [
    (None, 0),
    (ServingError(Code.DEADLINE_EXCEEDED, "the client's deadline, the engine ended it"), 0),
    (ServingError(Code.DEADLINE_EXCEEDED, "deadline exceeded before a decode replica took it", replica_fault=True), 1),
    (ServingError(Code.UNAVAILABLE, "no decode replica"), 1),
    (ServingError(Code.ABORTED, "the replica died after 1 token"), 1),
])
def test_the_gate_counts_what_the_versions_replicas_failed(error, errors):
    s = _outcome(error)
    assert (s.requests, s.errors, s.tokens, s.ttft_n, s.ttft_prompt_tokens) == (1, errors, 1, 1, 8)


def test_ttft_is_compared_per_prompt_token():
    o = RolloutOptions(max_ttft_ratio=3.0)
    base = VersionStats(requests=100, ttft_s=10.0, ttft_n=100, ttft_prompt_tokens=100 * 100)  # 0.1 s, 100 tokens
    # a tenant pins long prompts to the canary: 4x the TTFT for 4x the prompt is not slower
    longer = VersionStats(requests=100, ttft_s=40.0, ttft_n=100, ttft_prompt_tokens=100 * 400)
    assert Rollouts._tripped(longer, base, o) is None
    slower = VersionStats(requests=100, ttft_s=40.0, ttft_n=100, ttft_prompt_tokens=100 * 100)
    assert Rollouts._tripped(slower, base, o) == ("mean TTFT per prompt token 4.0 ms is 4.0x the baseline's 1.0 ms "
                                                  "(max 3x)")


class _Silent:
    """A decode deployment handle whose replicas never take a request (a pool that keeps dying or
    never wakes): its stream yields nothing until cancelled."""

    def __init__(self):
        self.cancelled = 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        handle = self

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await asyncio.Event().wait()

            def cancel(self):
                handle.cancelled += 1
        return Stream()


@pytest.mark.parametrize("deadline_s, wait_s, code", [
    (None, 0.3, Code.UNAVAILABLE),  # no deadline: replica_wait_s ends it
    (0.05, 5.0, Code.DEADLINE_EXCEEDED),  # the deadline (+ 1 s grace) comes first; still the replicas' doing
])
def test_a_request_no_replica_takes_always_ends(tiny_model, deadline_s, wait_s, code):
    import time

    from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer

    handle = _Silent()
    legs = DecodeLegs(handle, max_migrations=0, prefill=None, replica_wait_s=wait_s)
    deadline = None if deadline_s is None else time.time() + deadline_s
    client = ClientStream("r", IncrementalDetokenizer(Tokenizer(tiny_model), [1, 2], ()), [1, 2])

    async def run():
        started = time.monotonic()
        with pytest.raises(ServingError) as e:
            async for _ in legs.stream("rid", [1, 2], None, RequestContext(deadline=deadline), None, None, client):
                pass
        return e.value, time.monotonic() - started

    error, took = asyncio.run(run())
    assert (error.code, error.replica_fault, handle.cancelled) == (code, True, 1)
    assert took < (1.6 + deadline_s if deadline_s else wait_s + 0.6)  # the deadline's grace or the wait, not forever
