"""GroupGuard's decision when a tensor-parallel forward raises (no Ray: the ranks' answer and the
exit are injected; the whole path runs in tests/serving/test_poison_serving.py): a lost rank ends
the process before the step can end its requests (they migrate); a forward that failed with every
rank alive lets the step end its requests with the error, refuses every later forward, and ends the
process after the grace."""

import threading

import pytest

from cluster.serving.tensor_parallel import GroupGuard


class Ranks:
    def __init__(self, lost):
        self.lost, self.asked = lost, []

    def lost_within(self, timeout_s: float):
        self.asked.append(timeout_s)
        return self.lost


def failing(*args, **kwargs):
    raise ValueError("poison")


class Exit:
    def __init__(self, events: list):
        self.events, self.called = events, threading.Event()

    def __call__(self, code: int) -> None:
        self.events.append(("exit", code))
        self.called.set()


def test_a_lost_rank_ends_the_process_before_the_step_ends_its_requests():
    events = []
    ranks = Ranks(True)
    guard = GroupGuard(failing, ranks, Exit(events), loss_check_s=5.0, grace_s=60.0)
    with pytest.raises(ValueError):
        try:
            guard()
        except ValueError:
            events.append(("raised",))
            raise
    assert events == [("exit", 70), ("raised",)] and ranks.asked == [5.0]
    assert not guard.broken


def test_a_forward_that_failed_with_every_rank_alive_fails_its_step_then_ends_the_process():
    events = []
    exit = Exit(events)
    guard = GroupGuard(failing, Ranks(None), exit, loss_check_s=5.0, grace_s=0.2)
    with pytest.raises(ValueError):
        guard()
    events.append(("raised",))  # the engine ends the step's requests with the error now
    assert guard.broken
    assert exit.called.wait(10)
    assert events == [("raised",), ("exit", 70)]
    with pytest.raises(RuntimeError, match="the tensor-parallel group is broken"):
        guard()  # never on the broken group (the process would be gone by now)
