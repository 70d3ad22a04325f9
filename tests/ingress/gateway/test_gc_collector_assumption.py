"""The assumption under the GC deferral (cluster/telemetry/gc_pauses.py), stated (issue 52): the
collector is CPython's generational one (<= 3.13), whose third threshold triggers generation 2
and whose get_count()[2] counts the gen1 collections since the last full one. requires-python
admits 3.14, whose incremental collector ignores a third threshold: there the deferral must do
nothing rather than believe it deferred (checked on a stand-in with 3.14's documented behaviour,
as no 3.14 runs here)."""

import gc
import sys

from cluster.telemetry.gc_pauses import FullCollections, collect_when_quiet, generational_collector


def test_this_interpreters_collector_is_the_generational_one_the_deferral_is_written_for():
    saved = gc.get_threshold()
    assert generational_collector() is (sys.version_info < (3, 14))
    assert gc.get_threshold() == saved  # the probe puts the thresholds back
    if sys.version_info >= (3, 14):
        return
    gc.collect()
    assert gc.get_count()[2] == 0
    gc.collect(1)
    gc.collect(1)
    assert gc.get_count()[2] == 2  # gen1 collections since the last full one: what tick() reads
    gc.collect(2)
    assert gc.get_count()[2] == 0


class Incremental314:
    """The gc module's thresholds and counts as Python 3.14's incremental collector documents
    them: two generations; set_threshold ignores any value after the second; get_threshold()[2]
    is always 0."""

    def __init__(self):
        self.thresholds = (2000, 10)
        self.sets = 0

    def get_threshold(self):
        return (*self.thresholds, 0)

    def set_threshold(self, t0, t1=None, *_ignored):
        self.sets += 1
        self.thresholds = (t0, self.thresholds[1] if t1 is None else t1)

    def get_count(self):
        return (5, 0, 0)


def test_under_an_incremental_collector_nothing_is_deferred():
    stand_in = Incremental314()
    assert generational_collector(stand_in) is False
    collections = FullCollections(lambda: True, gc_module=stand_in).start()
    assert not collections.deferring and stand_in.get_threshold() == (2000, 10, 0)
    assert collections.tick() is None  # never a forced or idle "full" collection it believes it owes
    collections.stop()
    assert stand_in.get_threshold() == (2000, 10, 0)


def test_on_this_interpreter_the_deferral_starts_and_gives_the_thresholds_back():
    import asyncio

    saved = gc.get_threshold()

    async def run():
        task = collect_when_quiet(lambda: False)
        assert (task is not None) is (sys.version_info < (3, 14))
        if task is not None:
            assert gc.get_threshold()[2] == saved[2] * 100
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(run())
    assert gc.get_threshold() == saved
