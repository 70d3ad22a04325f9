"""The rollout gate judges a version by what its replicas did (issue 39): a deadline spent waiting
for a replica that never took the request counts against the version, a request always ends even
without a deadline, and TTFT is compared per prompt token."""

import asyncio

import pytest

from cluster.config.models import RolloutOptions
from cluster.engine.request import RequestContext
from cluster.errors import InvalidRequestError
from router.ingress.flow.legs import DecodeLegs, PrefillLeg
from router.ingress.flow.stream import ClientStream
from router.ingress.request import Delta
from router.ingress.status import Code, Rejected, ServingError
from router.ingress.versions.rollout import Recorder, Rollouts, VersionStats


def _outcome(ends: str | BaseException) -> VersionStats | None:
    """One request's record: the prefill's first token (prompt of 8), then `ends`: "finished" (the
    last delta ends it), "unfinished" (the stream stops without a finish), "client left" (the
    client closes it after the first token), or an exception raised after the first token."""
    async def stream():
        yield Delta("r", "a", [1], None, 8, 1)
        if ends == "finished":
            yield Delta("r", "b", [2], "length", 8, 2)
        elif isinstance(ends, BaseException):
            raise ends

    async def consume():
        rec = Recorder()
        deltas = rec.observe(("m", "v2"), stream())
        try:
            async for _ in deltas:
                if ends == "client left":
                    break
        except Exception:  # noqa: BLE001 — what the edge answers is not the point here
            pass
        await deltas.aclose()
        return rec.drain().get(("m", "v2"))

    return asyncio.run(consume())


@pytest.mark.parametrize("ends, record", [
    ("finished", (1, 0, 2, 1, 8)),
    # the version failed it: an error, and never a success with the prefill's one token
    (ServingError(Code.DEADLINE_EXCEEDED, "deadline exceeded before a decode replica took it", replica_fault=True),
     (1, 1, 0, 0, 0)),
    (ServingError(Code.DEADLINE_EXCEEDED, "deadline exceeded before a prefill replica answered", replica_fault=True),
     (1, 1, 0, 0, 0)),
    (ServingError(Code.UNAVAILABLE, "no decode replica took it within 120 s"), (1, 1, 0, 0, 0)),
    (ServingError(Code.ABORTED, "the replica died after 1 token"), (1, 1, 0, 0, 0)),
    (ServingError(Code.INTERNAL, "decode stream ended without a finish"), (1, 1, 0, 0, 0)),
    (RuntimeError("a bug of ours: INTERNAL at the edge"), (1, 1, 0, 0, 0)),
    ("unfinished", (1, 1, 0, 0, 0)),
    # the client's doing, or a refusal: no sample either way
    (ServingError(Code.DEADLINE_EXCEEDED, "the client's deadline: the engine that had it ended it"), None),
    (Rejected("the decode replica's queue is full", 1.0), None),
    (InvalidRequestError("sampling", "overflowed on this prompt"), None),
    ("client left", None),
])
def test_the_gate_counts_what_the_versions_replicas_failed_and_only_whole_answers_as_successes(ends, record):
    s = _outcome(ends)
    assert (s if s is None else (s.requests, s.errors, s.tokens, s.ttft_n, s.ttft_prompt_tokens)) == record


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


class _SilentPrefill:
    """A prefill deployment handle whose replicas never answer (a pool that is dead or asleep: Serve
    holds the call until a replica comes)."""

    def __init__(self):
        self.prefill = self
        self.cancelled = 0

    def options(self, **_):  # how a call travels (flow/legs.py `via`): one way here
        return self

    def remote(self, *args, **kwargs):
        async def never():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return never()


@pytest.mark.parametrize("deadline_s, wait_s, code, message", [
    (None, 0.3, Code.UNAVAILABLE, "request rid: no prefill replica answered within 0.3 s (fault_tolerance.replica_wait_s)"),
    (0.05, 5.0, Code.DEADLINE_EXCEEDED, "request rid: deadline exceeded before a prefill replica answered"),
])
def test_a_prefill_no_replica_answers_always_ends_as_the_versions_fault(deadline_s, wait_s, code, message):
    """Without a deadline a prefill call on a pool with no replica waited for ever; with one, it
    ended as the client's deadline and the gate never saw it."""
    import time

    handle = _SilentPrefill()
    leg = PrefillLeg(handle, replica_wait_s=wait_s)
    deadline = None if deadline_s is None else time.time() + deadline_s

    async def run():
        started = time.monotonic()
        with pytest.raises(ServingError) as e:
            await leg.first_token("rid", [1, 2], None, RequestContext(deadline=deadline), None, stream=None)
        return e.value, time.monotonic() - started

    error, took = asyncio.run(run())
    assert (error.code, error.message, error.replica_fault, handle.cancelled) == (code, message, True, 1)
    assert took < (1.6 + deadline_s if deadline_s else wait_s + 0.6)  # the deadline's grace or the wait
