"""gateway/counter_batch.py: the ingress's counter increments are summed on the loop and recorded
once per counter and tag set FLUSH_S after the first; off a loop an increment goes at once."""

import asyncio

from router.ingress.gateway.counter_batch import CounterBatch


class Recorded:
    """What a counter was given (Ray's Counter takes the same `inc(value, tags)`)."""

    def __init__(self):
        self.calls: list[tuple[float, dict | None]] = []

    def inc(self, value, tags=None):
        self.calls.append((value, tags))


def test_increments_on_a_loop_are_summed_by_tag_set_and_recorded_once_after_the_flush_delay():
    requests, tokens = Recorded(), Recorded()
    batch = CounterBatch(flush_s=0.05)

    async def main():
        for code in ("OK", "OK", "CANCELLED", "OK"):
            batch.inc(requests, 1, {"tenant": "a", "code": code})
        batch.inc(tokens, 64)
        batch.inc(tokens, 36)
        before = (list(requests.calls), list(tokens.calls))
        await asyncio.sleep(0.2)
        batch.inc(tokens, 5)  # after a flush: a sum of its own, flushed later
        after_first = list(tokens.calls)
        await asyncio.sleep(0.2)
        return before, after_first

    before, after_first = asyncio.run(main())
    assert before == ([], [])
    assert sorted(requests.calls, key=lambda c: c[1]["code"]) == [
        (1, {"tenant": "a", "code": "CANCELLED"}), (3, {"tenant": "a", "code": "OK"})]
    assert after_first == [(100, None)]
    assert tokens.calls == [(100, None), (5, None)]


def test_off_a_loop_an_increment_is_recorded_at_once_and_a_new_loop_flushes_what_the_last_left():
    counter = Recorded()
    batch = CounterBatch(flush_s=30.0)  # never flushed by its timer in this test
    batch.inc(counter, 2, {"reason": "cache"})
    assert counter.calls == [(2, {"reason": "cache"})]

    async def add(n):
        batch.inc(counter, n)

    asyncio.run(add(3))  # left unflushed when its loop closed
    assert counter.calls == [(2, {"reason": "cache"})]
    asyncio.run(add(4))  # another loop: the last one's sum goes first
    assert counter.calls == [(2, {"reason": "cache"}), (3, None)]
    batch.flush()
    assert counter.calls == [(2, {"reason": "cache"}), (3, None), (4, None)]
