"""Tenants in the scheduler (no model): priority classes, weighted fair queueing, KV budgets,
priority-aware preemption, bounded queues, queue time-to-live and deadlines — exact orders and
exact block counts. The queue time-to-live of a preempted request runs on the real engine."""

import itertools
import time

import pytest

from cluster.errors import QueueFullError
from cluster.engine.fair_queue import FairQueue
from cluster.engine.kv_cache import KVCacheManager
from cluster.engine.request import Priority, Request, RequestContext, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from tests.reference import hf_greedy


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, **kw):
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget, 1024, **kw)


_prompts = itertools.count(1)


def req(rid, n_prompt=4, max_tokens=8, arrival=0.0, **ctx):
    """A request whose prompt shares no block with any other (no prefix-cache hits)."""
    base = next(_prompts) * 1000
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, temperature=0),
                   arrival_time=arrival, ctx=RequestContext(**ctx))


def admitted(s: Scheduler) -> list[str]:
    """Run one step; the ids of requests admitted from the waiting queue in it, in order."""
    out = s.schedule()
    s.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
    return [c.request.request_id for c in out.chunks if c.start == 0]


def test_fair_queue_alternates_tenants_by_tokens_served_not_arrival():
    q = FairQueue()
    for i in range(3):
        q.append(req(f"a{i}", arrival=i, tenant="a"))
    for i in range(2):
        q.append(req(f"b{i}", arrival=10 + i, tenant="b"))
    order = []
    while q:
        r = q.peek()
        q.remove(r)
        q.charge(r.ctx, 100)
        order.append(r.request_id)
    # a0 first (earliest head at equal virtual time), then b catches up, then alternation
    assert order == ["a0", "b0", "a1", "b1", "a2"]


def test_fair_queue_weights_and_no_credit_for_idling():
    q = FairQueue()
    for i in range(8):
        q.append(req(f"h{i}", tenant="heavy", weight=3.0, arrival=i))
        q.append(req(f"l{i}", tenant="light", weight=1.0, arrival=i + 0.5))
    order = []
    for _ in range(8):
        r = q.peek()
        q.remove(r)
        q.charge(r.ctx, 30)
        order.append(r.request_id[0])
    # virtual times h: 10 20 30 | l: 30; ties go to the earlier head (l1 arrived at 1.5, h3 at 3)
    assert order == ["h", "l", "h", "h", "l", "h", "h", "h"]  # 6:2 = the weights' 3:1
    # A tenant that was idle re-enters at the smallest backlogged virtual time, not at its old one.
    q2 = FairQueue()
    q2.append(req("x0", tenant="x"))
    q2.remove(q2.peek())
    q2.append(req("busy", tenant="busy"))
    q2.charge(RequestContext(tenant="busy"), 1000)
    q2.append(req("x1", tenant="x"))
    assert q2.virtual_time("x") == 1000.0


def test_interactive_requests_are_admitted_before_batch_ones():
    s = make(budget=4, max_seqs=1)
    s.add(req("batch", arrival=0, tenant="b", priority=Priority.BATCH))
    s.add(req("inter", arrival=5, tenant="i"))
    assert admitted(s) == ["inter"]


def test_two_tenants_share_admission_fairly_whatever_the_arrival_order():
    s = make(budget=4, max_seqs=2)
    for i in range(4):
        s.add(req(f"a{i}", n_prompt=4, max_tokens=1, arrival=i, tenant="a"))
    for i in range(2):
        s.add(req(f"b{i}", n_prompt=4, max_tokens=1, arrival=10 + i, tenant="b"))
    order = []
    for _ in range(8):
        order += admitted(s)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert s.kv.num_free_blocks == 64


def test_a_tenant_over_its_kv_budget_waits_while_others_are_admitted():
    s = make(num_blocks=16, block_size=4, budget=64)
    # 25% of 16 blocks = 4 blocks; each request needs 3 blocks (12-token prompt)
    for i in range(2):
        s.add(req(f"a{i}", n_prompt=12, max_tokens=20, arrival=i, tenant="a", kv_budget=0.25))
    s.add(req("b0", n_prompt=12, max_tokens=20, arrival=5, tenant="b"))
    assert admitted(s) == ["a0", "b0"]  # a1 would bring tenant a to 6 blocks
    assert [r.request_id for r in s.waiting] == ["a1"]
    s.finish("a0", RequestStatus.FINISHED_ABORTED)
    assert admitted(s) == ["a1"]
    s.finish("a1", RequestStatus.FINISHED_ABORTED)
    s.finish("b0", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16
    s.check_invariants()


def test_preemption_takes_a_batch_request_before_a_later_interactive_one():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(req("batch", n_prompt=8, max_tokens=40, arrival=0, tenant="b", priority=Priority.BATCH))
    s.add(req("inter", n_prompt=8, max_tokens=40, arrival=1, tenant="i"))
    admitted(s)
    preempted = []
    for _ in range(12):
        out = s.schedule()
        preempted += [r.request_id for r in out.preempted]
        s.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
        if preempted:
            break
    assert preempted == ["batch"]
    assert [r.request_id for r in s.running] == ["inter"]
    s.check_invariants()


def test_a_full_waiting_queue_refuses_more():
    s = make(max_waiting=2)
    s.add(req("a"))
    s.add(req("b"))
    with pytest.raises(QueueFullError, match="max_waiting 2"):
        s.add(req("c"))
    assert "c" not in s.requests


def test_queue_ttl_rejects_requests_never_admitted_from_their_arrival():
    s = make(budget=4, max_seqs=1, queue_ttl_s=5.0)
    s.add(req("first", max_tokens=30, arrival=0.0))
    s.add(req("second", arrival=1.0))
    admitted(s)
    assert s.expire(now=0.0, now_mono=5.9) == []
    expired = s.expire(now=0.0, now_mono=6.0)
    assert [(r.request_id, r.status) for r in expired] == [("second", RequestStatus.FINISHED_REJECTED)]
    assert "time-to-live (5 s)" in expired[0].error
    assert [r.request_id for r in s.running] == ["first"]


def test_a_preempted_request_is_rejected_after_queue_ttl_s_waiting_since_its_preemption(tiny_model):
    """The time-to-live counts the wait, not the time the request ran: one that ran 60 s and was
    preempted is still resumable 4.9 s later, and rejected at 5 s (the old rule never did: a
    preempted request waited without a bound)."""
    from cluster.engine.llm_engine import LLMEngine

    now = [0.0]
    engine = LLMEngine.from_model(tiny_model, num_blocks=4, max_num_batched_tokens=64, queue_ttl_s=5.0)
    now[0] = time.monotonic()  # the requests' arrival times are real monotonic times
    engine.scheduler.clock = lambda: now[0]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pa, pb = [256] + list(range(1, 20)), [256] + list(range(40, 59))  # 2 blocks of 16 each: the pool is full
    engine.add_request("a", prompt_token_ids=pa, sampling=sp)
    engine.add_request("b", prompt_token_ids=pb, sampling=sp)
    outs: dict[str, list] = {"a": [], "b": []}
    while engine.stats.preemptions == 0:  # at 33 tokens each needs a 3rd block: b (the later) goes
        now[0] += 5.0  # they run a long time: a TTL counted from arrival would reject b at once
        for o in engine.step():
            outs[o.request_id].append(o)
    preempted_at = now[0]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"] and len(outs["b"]) == 13
    now[0] = preempted_at + 4.9
    for o in engine.step():
        outs[o.request_id].append(o)
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]  # still waiting: a holds 3 of 4 blocks
    now[0] = preempted_at + 5.0
    for o in engine.step():
        outs[o.request_id].append(o)
    last = outs["b"][-1]
    assert (last.finished, last.finish_reason, last.error) == (True, "rejected", (
        "back in the queue after 13 output tokens (preempted) and not resumed within the queue "
        "time-to-live (5 s): overloaded"))
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    assert sum((o.token_ids for o in outs["a"]), []) == hf_greedy(tiny_model, pa, 20)
    assert outs["a"][-1].finish_reason == "length"
    engine.check_invariants()
    assert engine.kv.num_free_blocks == 4 and engine.stats.finished_by_reason == {"length": 1, "rejected": 1}


def test_deadline_stops_running_and_waiting_requests_and_frees_their_blocks():
    s = make(num_blocks=16, budget=64, max_seqs=1)
    s.add(req("run", n_prompt=8, max_tokens=30, deadline=100.0))
    s.add(req("wait", n_prompt=8, deadline=100.0))
    s.add(req("free", n_prompt=8))
    admitted(s)
    admitted(s)
    assert s.kv.num_free_blocks == 13
    assert s.expire(now=99.9, now_mono=0.0) == []
    expired = s.expire(now=100.0, now_mono=0.0)
    assert sorted((r.request_id, r.status.value) for r in expired) == [("run", "deadline"), ("wait", "deadline")]
    assert expired[0].error.startswith("deadline exceeded after")
    assert s.kv.num_free_blocks == 16 and s._num_deadlines == 0
    assert admitted(s) == ["free"]
    s.check_invariants()
