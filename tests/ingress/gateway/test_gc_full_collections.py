"""Full (generation 2) collections off the collector's schedule while serving, run at quiet moments
or after max_interval_s under load (cluster/telemetry/gc_pauses.FullCollections). The clock and
the idle answer are injected; the collector itself is the real one."""

import gc

import pytest

from cluster.telemetry.gc_pauses import DEFERRED_FACTOR, FullCollections, FullCollectionStats, idle_from


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FullCounter:
    """Counts the collector's gen2 collections (gc.callbacks), whoever started them."""

    def __init__(self):
        self.full = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.full += 1


@pytest.fixture
def full_counter():
    saved = gc.get_threshold()
    counter = FullCounter()
    gc.collect()  # gen2's long-lived total is today's heap; what a test allocates is counted from 0
    gc.callbacks.append(counter)
    try:
        yield counter
    finally:
        gc.callbacks.remove(counter)
        gc.set_threshold(*saved)


def pressure(keep: list) -> None:
    """Enough gen1 collections for an automatic gen2 (count > threshold 10), and enough survivors
    that the collector's own rule (gen2 runs once new long-lived objects are a quarter of those a
    full collection left) allows it: half as many live containers as the heap holds, each a cycle."""
    for i in range(max(200_000, len(gc.get_objects(generation=2)) // 2)):
        node = [i]
        node.append(node)
        keep.append(node)


def test_the_collector_runs_gen2_by_itself_under_that_pressure(full_counter):
    """The control: the same pressure without deferral ends in an automatic full collection."""
    keep: list = []
    pressure(keep)
    assert full_counter.full >= 1


def test_while_deferred_gen2_does_not_run_under_allocation_pressure(full_counter):
    t0, t1, t2 = gc.get_threshold()
    clock = Clock()
    collections = FullCollections(lambda: False, clock=clock, stats=FullCollectionStats()).start()
    assert gc.get_threshold() == (t0, t1, t2 * DEFERRED_FACTOR)
    keep: list = []
    pressure(keep)
    assert full_counter.full == 0
    assert gc.get_count()[2] > t2  # the collector would have run it
    assert collections.tick() is None  # busy: nothing runs, the deferral is counted once
    assert collections.tick() is None
    assert collections.stats.deferred == 1 and collections.stats.idle.count == collections.stats.forced.count == 0
    collections.stop()
    assert gc.get_threshold() == (t0, t1, t2)  # stopping restores the collector's own schedule


def test_an_idle_moment_collects_after_quiet_s():
    clock, idle = Clock(), [False]
    calls: list[int] = []
    collections = FullCollections(lambda: idle[0], quiet_s=0.5, clock=clock, collect=calls.append,
                                  stats=FullCollectionStats())
    saved = gc.get_threshold()
    collections.start()
    try:
        gc.collect(1)  # gen2 now holds something new: gc.get_count()[2] == 1
        assert collections.tick() is None  # busy
        idle[0] = True
        clock.t += 0.25
        assert collections.tick() is None  # idle since now
        clock.t += 0.25
        assert collections.tick() is None  # 0.25 s quiet
        clock.t += 0.25
        assert collections.tick() == "idle"  # 0.5 s quiet
        assert calls == [2]
        assert collections.stats.idle.count == 1 and collections.stats.forced.count == 0
    finally:
        collections.stop()
    assert gc.get_threshold() == saved


def test_an_idle_process_with_nothing_new_in_gen2_does_not_collect():
    clock = Clock()
    calls: list[int] = []
    collections = FullCollections(lambda: True, quiet_s=0.5, clock=clock, collect=calls.append,
                                  stats=FullCollectionStats()).start()
    try:
        gc.collect(2)  # gen2's count back to 0: nothing new since
        for _ in range(10):
            assert collections.tick() is None
            clock.t += 0.25
        assert calls == [] and gc.get_count()[2] == 0
    finally:
        collections.stop()


def test_the_max_interval_forces_a_collection_under_constant_load():
    clock = Clock()
    collections = FullCollections(lambda: False, max_interval_s=30.0, clock=clock,
                                  stats=FullCollectionStats()).start()
    try:
        gc.collect(1)  # gen2 holds something new from t=1000 (the first tick)
        whens = []
        for _ in range(int(70 / 0.25)):
            if (why := collections.tick()) is not None:
                whens.append((clock.t - 1000.0, why))
            if gc.get_count()[2] == 0:
                gc.collect(1)  # constant load: gen1 keeps promoting into gen2
            clock.t += 0.25
        # 30 s after gen2 first held anything new; again 30 s after the next tick saw it dirty
        assert whens == [(30.0, "forced"), (60.25, "forced")]
        assert collections.stats.forced.count == 2 and collections.stats.idle.count == 0
        assert collections.stats.forced.max_s > 0
    finally:
        collections.stop()


def test_an_idle_answer_needs_no_arrival_since_the_last_question_and_nothing_in_flight():
    arrived, inflight = [0], [0]
    idle = idle_from(lambda: (arrived[0], inflight[0]))
    assert idle() is False  # nothing to compare with yet
    assert idle() is True
    arrived[0] += 1  # a call came and went between two questions
    assert idle() is False
    assert idle() is True
    inflight[0] = 1
    assert idle() is False
    inflight[0] = 0
    assert idle() is True


def test_the_garbage_a_collection_finds_is_counted():
    found: list[int] = []

    def collect(generation: int) -> int:
        found.append(gc.collect(generation))
        return found[-1]

    collections = FullCollections(lambda: True, quiet_s=0.0, clock=Clock(), collect=collect,
                                  stats=FullCollectionStats()).start()
    try:
        holder = []
        for _ in range(1000):  # 1,000 cycles of two lists each
            a, b = [], []
            a.append(b)
            b.append(a)
            holder.append(a)
        del a, b
        gc.collect(1)  # alive: promoted into gen2
        holder.clear()  # unreachable now, in gen2: only a full collection finds them
        assert collections.tick() == "idle"
        assert found[0] >= 2000 and collections.stats.freed == found[0]
    finally:
        collections.stop()
