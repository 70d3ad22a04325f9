"""The garbage collector on the serving path (cluster/telemetry/gc_pauses.py): every collection is
timed by generation, and freezing moves start-up's objects out of every later collection."""

import gc

from cluster.telemetry.gc_pauses import GcPauses, freeze_after_start


def test_collections_are_counted_by_generation():
    pauses = GcPauses().install()
    try:
        gc.collect(2)
        gc.collect(1)
        gc.collect(1)
    finally:
        pauses.uninstall()
    gc.collect(2)  # after uninstall: not counted
    full, middle = pauses.by_generation[2], pauses.by_generation[1]
    assert (full.count, middle.count) == (1, 2)
    assert 0 < full.max_s <= full.total_s and 0 < middle.max_s <= middle.total_s
    summary = pauses.summary()  # what an engine replica's load() reports
    assert summary[2] == (1, full.total_s, full.max_s) and summary[1] == (2, middle.total_s, middle.max_s)


def test_freezing_takes_start_up_objects_out_of_collections():
    before = gc.get_freeze_count()
    survivors = [[i] for i in range(10_000)]  # tracked containers, alive "since start-up"
    try:
        frozen = freeze_after_start()
        # not frozen == get_freeze_count() later: a frozen object another thread drops is freed and
        # leaves the count in between (11 of 675,740 did in one fresh-clone run); the survivors stay
        assert frozen >= before + len(survivors) and gc.get_freeze_count() >= before + len(survivors)
        tracked = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(s) in tracked for s in survivors)  # a full collection never walks them
    finally:
        gc.unfreeze()  # the test process's heap goes back to normal
    assert gc.get_freeze_count() == 0
