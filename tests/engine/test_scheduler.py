"""Scheduler without a model: chunk interleaving, preemption, abort, prefix hits, leak checks."""

from cluster.engine.kv_cache import KVCacheManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=1024):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_seqs, budget, max_len)


def req(rid, n_prompt, max_tokens=8, base=0):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, temperature=0))


def step(s: Scheduler, token=7):
    out = s.schedule()
    s.update(out, {c.request.request_id: token for c in out.chunks if c.samples})
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks], out


def test_long_prompt_chunks_interleave_with_running_decodes():
    s = make(budget=16)
    s.add(req("short", 3, max_tokens=20))
    assert step(s)[0] == [("short", 0, 3)]
    s.add(req("long", 40))
    # Every step: the decode first, then a chunk of the long prompt with the rest of the budget.
    assert step(s)[0] == [("short", 3, 1), ("long", 0, 15)]
    assert step(s)[0] == [("short", 4, 1), ("long", 15, 15)]
    assert step(s)[0] == [("short", 5, 1), ("long", 30, 10)]
    assert step(s)[0] == [("short", 6, 1), ("long", 40, 1)]
    s.check_invariants()


def test_decodes_go_first_even_when_the_prefill_was_admitted_earlier():
    s = make(budget=8)
    s.add(req("a", 2, max_tokens=30))
    s.add(req("long", 30))
    assert step(s)[0] == [("a", 0, 2), ("long", 0, 6)]
    assert step(s)[0] == [("a", 2, 1), ("long", 6, 7)]


def test_finish_frees_every_block():
    s = make(num_blocks=16, block_size=4)
    s.add(req("a", 5, max_tokens=3))
    s.add(req("b", 9, max_tokens=2))
    finished = []
    for _ in range(10):
        _, out = step(s)
        finished += [c.request for c in out.chunks if c.request.status.finished]
    assert {r.request_id for r in finished} == {"a", "b"}
    assert [r.status for r in finished] == [RequestStatus.FINISHED_LENGTH] * 2
    assert s.kv.num_free_blocks == 16
    s.check_invariants()


def test_abort_at_any_moment_frees_blocks():
    for abort_after in range(6):
        s = make(num_blocks=16, block_size=4, budget=4)
        s.add(req("a", 10, max_tokens=4))
        s.add(req("b", 3, max_tokens=4))
        for _ in range(abort_after):
            step(s)
        s.finish("a", RequestStatus.FINISHED_ABORTED)
        s.finish("b", RequestStatus.FINISHED_ABORTED)
        s.check_invariants()
        assert s.kv.num_free_blocks == 16, abort_after
        assert not s.has_work()


def test_preemption_when_blocks_run_out_recomputes_the_latest_request():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(req("old", 8, max_tokens=8))  # 2 blocks
    s.add(req("new", 12, max_tokens=8, base=100))  # 3 blocks
    assert step(s)[0] == [("old", 0, 8), ("new", 0, 12)]  # 5 of 6 blocks used
    # Both now need a new block at position 8 / 12 ... old gets the last one; new is preempted.
    chunks, out = step(s)
    assert chunks == [("old", 8, 1)]
    assert [r.request_id for r in out.preempted] == ["new"]
    new = s.requests["new"]
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.all_token_ids == list(range(100, 112)) + [7]  # keeps its output; recomputes it
    s.check_invariants()
    while s.has_work():
        step(s)
    assert s.kv.num_free_blocks == 6
    s.check_invariants()


def test_waiting_request_reuses_a_cached_prefix():
    s = make(num_blocks=32, block_size=4)
    s.add(req("a", 10, max_tokens=1))
    step(s)
    assert not s.has_work()
    s.add(req("b", 13, max_tokens=1))  # same first 10 tokens: 2 full blocks cached
    chunks, _ = step(s)
    assert chunks == [("b", 8, 5)]
    assert s.requests == {} and s.kv.num_free_blocks == 32


def test_max_num_seqs_bounds_running_requests():
    s = make(max_seqs=2, budget=64)
    for i in range(3):
        s.add(req(f"r{i}", 4, base=10 * i))
    chunks, _ = step(s)
    assert [c[0] for c in chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]
