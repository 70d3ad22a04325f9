"""router/ingress/flow/relay.py: items arrive in order and complete; what queued while the consumer
was busy comes merged; errors arrive after the items before them; leaving early stops the source."""

import asyncio

import pytest

from router.ingress.flow import relay
from router.ingress.flow.relay import coalesce


def merge(a, b):
    return a + b


async def _source(chunks, error: Exception | None = None):
    for c in chunks:
        yield c
        await asyncio.sleep(0)
    if error is not None:
        raise error


def test_a_consumer_that_keeps_up_gets_every_item_alone_in_order():
    async def run():
        out = []
        async for x in coalesce(_source([[1], [2], [3]]), merge):
            out.append(x)
        return out

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_items_queued_while_the_consumer_was_busy_come_merged_and_a_final_item_stays_apart():
    async def run():
        q = [[1], [2], [3], [4, "end"], [5]]
        src = _source(q)
        out = []
        agen = coalesce(src, merge, final=lambda x: "end" in x)
        out.append(await agen.__anext__())  # [1]
        for _ in range(20):  # the consumer is busy: the pump queues the rest
            await asyncio.sleep(0)
        async for x in agen:
            out.append(x)
        return out

    assert asyncio.run(run()) == [[1], [2, 3, 4, "end"], [5]]


def test_an_item_alone_is_never_merged_into_the_items_before_it():
    """A failed output after queued tokens: the tokens reach the client first, as unmerged."""
    async def run():
        src = _source([[1], [2], [3], ["failed"], [5]])
        agen = coalesce(src, merge, alone=lambda x: "failed" in x)
        out = [await agen.__anext__()]
        for _ in range(20):
            await asyncio.sleep(0)
        async for x in agen:
            out.append(x)
        return out

    assert asyncio.run(run()) == [[1], [2, 3], ["failed", 5]]


def test_the_sources_error_comes_after_its_items():
    async def run():
        out = []
        agen = coalesce(_source([[1], [2]], error=ValueError("lost")), merge)
        with pytest.raises(ValueError, match="lost"):
            async for x in agen:
                out.append(x)
                for _ in range(10):
                    await asyncio.sleep(0)
        return out

    assert asyncio.run(run()) == [[1], [2]]


def test_leaving_early_cancels_the_source():
    closed = []

    async def endless():
        try:
            i = 0
            while True:
                yield [i]
                i += 1
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def run():
        agen = coalesce(endless(), merge)
        first = await agen.__anext__()
        await agen.aclose()
        return first

    assert asyncio.run(run()) == [0]
    assert closed == [True]


def test_leaving_after_a_final_item_lets_the_source_end_uncancelled():
    """A finished call's stream is read to its end, not cancelled (a cancel resets a gRPC call)."""
    how = []

    async def finishing():
        try:
            yield [1, "end"]
            await asyncio.sleep(0)  # the call's end arrives after its last message
            how.append("ended")
        except BaseException as e:  # noqa: BLE001 — what stopped it is the point
            how.append(type(e).__name__)
            raise

    async def run():
        agen = coalesce(finishing(), merge, final=lambda x: "end" in x)
        first = await agen.__anext__()
        await agen.aclose()  # the consumer leaves at once, as a finished request's leg does
        pumps = set(relay._draining)
        await asyncio.wait_for(asyncio.gather(*pumps), 5)
        return first, len(pumps)

    assert asyncio.run(run()) == ([1, "end"], 1)
    assert how == ["ended"]
    assert relay._draining == set()


def test_a_source_that_does_not_end_after_its_final_item_is_cancelled_after_the_grace(monkeypatch):
    monkeypatch.setattr(relay, "DRAIN_S", 0.01)
    how = []

    async def lingering():
        try:
            yield [1, "end"]
            await asyncio.Event().wait()  # never ends by itself
        except BaseException as e:  # noqa: BLE001
            how.append(type(e).__name__)
            raise

    async def run():
        agen = coalesce(lingering(), merge, final=lambda x: "end" in x)
        await agen.__anext__()
        await agen.aclose()
        (pump,) = relay._draining
        await asyncio.wait_for(asyncio.gather(pump, return_exceptions=True), 5)

    asyncio.run(run())
    assert how == ["CancelledError"]
    assert relay._draining == set()
