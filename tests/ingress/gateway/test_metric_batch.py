"""gateway/metric_batch.py: the ingress's metrics are appended on the caller's thread and recorded by
the batch's own thread FLUSH_S later: counters summed by counter and tag set, histogram values one
by one; `flush()` records what is there at once."""

import threading

from router.ingress.gateway.metric_batch import MetricBatch


class Recorded:
    """What a metric was given (Ray's Counter.inc and Histogram.observe take `(value, tags)`), and on
    which thread."""

    def __init__(self):
        self.calls: list[tuple[float, dict | None]] = []
        self.threads: set[str] = set()
        self.seen = threading.Event()

    def _record(self, value, tags=None):
        self.calls.append((value, tags))
        self.threads.add(threading.current_thread().name)
        self.seen.set()

    inc = observe = _record


def test_counters_are_summed_by_tag_set_and_histograms_kept_value_by_value():
    requests, tokens, ttft = Recorded(), Recorded(), Recorded()
    batch = MetricBatch(flush_s=3600)  # its thread never wakes in this test: flush() records
    for code in ("OK", "OK", "CANCELLED", "OK"):
        batch.inc(requests, 1, {"tenant": "a", "code": code})
    batch.inc(tokens, 64)
    batch.inc(tokens, 36)
    for v in (0.25, 0.5, 0.25):
        batch.observe(ttft, v, {"tenant": "a"})
    assert (requests.calls, tokens.calls, ttft.calls) == ([], [], [])
    batch.flush()
    assert sorted(requests.calls, key=lambda c: c[1]["code"]) == [
        (1, {"tenant": "a", "code": "CANCELLED"}), (3, {"tenant": "a", "code": "OK"})]
    assert tokens.calls == [(100, None)]
    assert ttft.calls == [(0.25, {"tenant": "a"}), (0.5, {"tenant": "a"}), (0.25, {"tenant": "a"})]
    batch.inc(tokens, 5)  # after a flush: a sum of its own
    batch.flush()
    assert tokens.calls == [(100, None), (5, None)]


def test_the_batchs_own_thread_records_within_the_flush_delay():
    counter, histogram = Recorded(), Recorded()
    batch = MetricBatch(flush_s=0.01)
    try:
        batch.inc(counter, 2, {"reason": "cache"})
        batch.observe(histogram, 0.125)
        assert counter.seen.wait(5) and histogram.seen.wait(5)
        assert (counter.calls, histogram.calls) == ([(2, {"reason": "cache"})], [(0.125, None)])
        assert counter.threads == histogram.threads == {"pdserve-metrics"}
    finally:
        batch.close()


def test_close_stops_the_thread_and_records_what_is_left():
    counter = Recorded()
    batch = MetricBatch(flush_s=3600)
    batch.inc(counter, 1)
    thread = batch._thread
    batch.inc(counter, 2)
    batch.close()
    assert counter.calls == [(3, None)] and not thread.is_alive()


def test_a_failing_value_is_logged_and_the_others_and_the_thread_go_on(caplog):
    class Broken:
        def inc(self, value, tags=None):
            raise ValueError("Unrecognized tag key")

    ok, histogram = Recorded(), Recorded()
    batch = MetricBatch(flush_s=0.01)
    try:
        batch.inc(Broken(), 1, {"bogus": "x"})  # Ray refuses it
        batch.inc(ok, 1, {"tenant": ["not", "hashable"]})  # a tag set that cannot be summed
        batch.inc(ok, None)  # a value that cannot be added
        batch.observe(histogram, 0.5)
        assert histogram.seen.wait(5)
        batch.inc(ok, 1)  # after the failures: the thread still records
        assert ok.seen.wait(5)
    finally:
        batch.close()
    assert ok.calls == [(1, None)] and histogram.calls == [(0.5, None)]
    assert caplog.text.count("recording a metric failed") == 3
