"""Poison containment in the legs (no Ray: the handles are fakes that answer as a replica whose
forward failed does): an engine that ends a request because the forward holding it raised
(ErrorKind.FORWARD) ends it at the ingress with INTERNAL naming the request, the pool and the
replica; a prefill is not redone on decode and a decode leg does not migrate. Any other prefill
error still falls back to decode (the fallback is for the replica's faults, not the request's)."""

import asyncio

import pytest

from cluster.engine.outputs import FinishReason, RequestOutput
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.errors import ErrorKind
from prefill.result import PrefillResult
from router.ingress.flow.legs import DecodeLegs, ForwardFailed, PrefillLeg
from router.ingress.flow.stream import ClientStream
from router.ingress.status import Code

STEP_FAILED = "engine step failed: PoisonError: fault injection: the forward's input holds poison token 7"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class Prefill:
    """A prefill deployment handle whose every prefill returns `result`; counts the calls."""

    def __init__(self, result: PrefillResult):
        self.result, self.calls = result, 0
        self.prefill = self

    def options(self, **_):
        return self

    async def remote(self, *args, **kwargs):
        self.calls += 1
        return self.result


class Decode:
    """A decode deployment handle whose every stream sends `outputs`; counts the legs started."""

    def __init__(self, outputs: list[RequestOutput]):
        self.outputs, self.legs = outputs, 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        self.legs += 1
        outputs = iter(self.outputs)

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                try:
                    return next(outputs)
                except StopIteration:
                    raise StopAsyncIteration from None

            def cancel(self):
                pass
        return Stream()


def client(tiny_model) -> ClientStream:
    return ClientStream("rid", IncrementalDetokenizer(Tokenizer(tiny_model), [1, 2], ()), [1, 2])


def test_a_prefill_whose_forward_failed_is_not_redone_on_decode(tiny_model):
    prefill = Prefill(PrefillResult("rid", None, FinishReason.ERROR, STEP_FAILED, error_kind=ErrorKind.FORWARD))
    leg = PrefillLeg(prefill)
    with pytest.raises(ForwardFailed) as e:
        asyncio.run(leg.first_token("rid", [1, 2], GREEDY, RequestContext(), "p-0", client(tiny_model)))
    assert (e.value.code, e.value.message, e.value.contained_pool) == (
        Code.INTERNAL, f"request rid: the forward holding it failed on prefill replica p-0 after 0 tokens "
                       f"({STEP_FAILED}); not retried on another replica, as it may be what made the forward fail",
        "prefill")
    assert prefill.calls == 1


def test_another_prefill_error_still_falls_back_to_decode(tiny_model):
    prefill = Prefill(PrefillResult("rid", None, FinishReason.ERROR, "lease failed", error_kind=ErrorKind.INTERNAL))
    first = asyncio.run(PrefillLeg(prefill).first_token("rid", [1, 2], GREEDY, RequestContext(), "p-0",
                                                        client(tiny_model)))
    assert first is None  # decode prefills locally


def test_a_decode_leg_whose_forward_failed_does_not_migrate(tiny_model):
    decode = Decode([RequestOutput("rid", [5], "", False, None, 2, 1, 0),
                     RequestOutput("rid", [], "", True, FinishReason.ERROR, 2, 1, 0, STEP_FAILED, ErrorKind.FORWARD)])
    legs = DecodeLegs(decode, max_migrations=2, prefill=None)
    got = []

    async def run():
        async for d in legs.stream("rid", [1, 2], GREEDY, RequestContext(), None, "d-0", client(tiny_model), "decode"):
            got.append(d.token_ids)

    with pytest.raises(ForwardFailed) as e:
        asyncio.run(run())
    assert (e.value.code, e.value.message) == (
        Code.INTERNAL, f"request rid: the forward holding it failed on decode replica d-0 after 1 tokens "
                       f"({STEP_FAILED}); not retried on another replica, as it may be what made the forward fail")
    assert got == [[5]] and decode.legs == 1  # one replica, no migration
