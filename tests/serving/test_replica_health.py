"""A replica whose every engine step fails: the engine counts the failures in a row, the health
check fails after fault_tolerance.max_consecutive_step_errors, the router avoids it meanwhile.
No Ray: the failure is injected by wrapping the model runner from outside (as faults.py does)."""

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.loop import EngineLoop
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.replica import EngineReplica
from cluster.serving.replica_health import ReplicaHealth
from cluster.serving.reporting import FAILING_HOLD_S, LoadReporter
from kv_transfer.stats import TransferStats

SP = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class BrokenRunner:
    """The real runner, whose execute raises while `broken` (a GPU fault, a bad kernel)."""

    def __init__(self, runner):
        self._runner = runner
        self.broken = True

    def execute(self, *args, **kwargs):
        if self.broken:
            raise RuntimeError("injected: CUDA error")
        return self._runner.execute(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._runner, name)


@pytest.fixture()
def engine(tiny_model):
    eng = LLMEngine.from_model(tiny_model, num_blocks=32)
    eng.runner = BrokenRunner(eng.runner)
    return eng


def failed_step(engine: LLMEngine, rid: str) -> None:
    engine.add_request(rid, prompt_token_ids=[256, 1, 2, 3], sampling=SP)
    (out,) = engine.step()
    assert out.finish_reason == "error"


def test_the_engine_counts_failed_steps_in_a_row_and_a_step_that_runs_resets_it(engine):
    for i in range(3):
        failed_step(engine, f"f{i}")
        assert engine.stats.consecutive_step_errors == i + 1
    engine.runner.broken = False
    engine.add_request("ok", prompt_token_ids=[256, 1, 2, 3], sampling=SP)
    engine.step()
    assert (engine.stats.consecutive_step_errors, engine.stats.step_errors) == (0, 3)
    while engine.has_unfinished():
        engine.step()
    engine.runner.broken = True
    failed_step(engine, "again")
    assert (engine.stats.consecutive_step_errors, engine.stats.step_errors) == (1, 4)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def replica_around(engine: LLMEngine, max_errors: int) -> EngineReplica:
    """The real EngineReplica.check_health over a real loop, without the Ray-bound constructor."""
    replica = object.__new__(EngineReplica)
    replica.pool, replica.engine, replica.loop = "decode", engine, EngineLoop(engine)
    replica.health = ReplicaHealth("decode", engine, replica.loop, None, 30.0, max_errors)
    return replica


def test_health_fails_after_max_consecutive_step_errors(engine):
    replica = replica_around(engine, max_errors=3)
    try:
        for i in range(2):
            failed_step_on_loop(replica, f"f{i}")
            replica.check_health()  # 1, 2 failures in a row: still healthy
        failed_step_on_loop(replica, "f2")
        with pytest.raises(RuntimeError, match=r"the last 3 steps failed \(max_consecutive_step_errors 3\)"):
            replica.check_health()
    finally:
        replica.loop.shutdown(timeout=5)


def failed_step_on_loop(replica: EngineReplica, rid: str) -> None:
    """One failing request through the loop thread (the engine is the loop's alone)."""
    import asyncio

    async def run():
        outs = [o async for o in replica.loop.generate(rid, prompt_token_ids=[256, 1, 2, 3], sampling=SP)]
        assert outs[-1].finish_reason == "error"

    asyncio.run(run())


def test_a_replica_whose_last_step_failed_is_reported_failing_for_a_while(engine):
    reporter = LoadReporter(engine, TransferStats(), "decode-x", "decode", registry=None)
    failed_step(engine, "f0")
    failed_at = engine.stats.last_step_error_at
    assert reporter.replica_load(engine.load(), failed_at + 1.0).failing
    assert not reporter.replica_load(engine.load(), failed_at + FAILING_HOLD_S).failing  # gets requests again
    engine.runner.broken = False
    engine.add_request("ok", prompt_token_ids=[256, 1, 2, 3], sampling=SP)
    engine.step()
    assert not reporter.replica_load(engine.load(), failed_at + 1.0).failing


class RaisingScheduler:
    """The real scheduler, whose schedule raises (a bug in the scheduling path, not the forward)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler

    def schedule(self):
        raise RuntimeError("injected: scheduling bug")

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def test_a_step_that_raises_out_of_the_engine_counts_and_trips_health(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=32)
    engine.scheduler = RaisingScheduler(engine.scheduler)
    replica = replica_around(engine, max_errors=2)
    try:
        failed_step_on_loop(replica, "f0")  # the loop fails every request of the replica ...
        replica.check_health()
        failed_step_on_loop(replica, "f1")  # ... and counts each such step: health trips
        with pytest.raises(RuntimeError, match=r"the last 2 steps failed \(max_consecutive_step_errors 2\)"):
            replica.check_health()
        assert engine.stats.step_errors == 2 and engine.kv.num_free_blocks == 32
    finally:
        replica.loop.shutdown(timeout=5)
