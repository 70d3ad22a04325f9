"""Fault injection from outside (chaos tests and drills): wrappers put around a replica's NIXL
agent and model runner only when `fault_tolerance.fault_injection` is on. The hot classes carry
no test branches; the faults still act on the real paths (the READs run, the step is timed)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Literal

PullFault = Literal["none", "drop", "stall"]
NoticeFault = Literal["send", "drop"]


@dataclass
class Faults:
    """What is injected now; the wrappers read it on every call."""

    pull: PullFault = "none"  # drop: every READ fails at completion; stall: none completes (times out)
    notices: NoticeFault = "send"  # drop: every lease notice to prefill is lost (as a killed decode's unsent ones)
    step_delay_s: float = 0.0  # added to every model step (a slow node)
    fail_requests: float = 0.0  # the fraction of new requests a decode replica fails before any work (a bad version)
    poison_token: int | None = None  # a forward whose input holds this token id raises (a poison request)
    poisoned: int = 0  # forwards that raised for it

    def fails_request(self) -> bool:
        return self.fail_requests > 0 and random.random() < self.fail_requests


class _FaultyAgent:
    """A NIXL agent whose transfer states lie as `faults.pull` says."""

    def __init__(self, agent, faults: Faults):
        self._agent = agent
        self._faults = faults

    def check_xfer_state(self, handle) -> str:
        state = self._agent.check_xfer_state(handle)
        if self._faults.pull == "drop":
            return "ERR"
        if self._faults.pull == "stall" and state == "DONE":
            return "PROC"
        return state

    def __getattr__(self, name):
        return getattr(self._agent, name)


class _FaultyNotices:
    """A decode engine's lease-notice sender that loses every notice while `faults.notices` is "drop"."""

    def __init__(self, sender, faults: Faults):
        self._sender = sender
        self._faults = faults

    def send(self, notices) -> None:
        if self._faults.notices != "drop":
            self._sender.send(notices)

    def __getattr__(self, name):
        return getattr(self._sender, name)


class _SlowRunner:
    """A model runner whose every step takes `faults.step_delay_s` longer (inside the timed step)."""

    def __init__(self, runner, faults: Faults):
        self._runner = runner
        self._faults = faults

    def execute(self, *args, **kwargs):
        sampled = self._runner.execute(*args, **kwargs)
        if self._faults.step_delay_s:
            time.sleep(self._faults.step_delay_s)
        return sampled

    def __getattr__(self, name):
        return getattr(self._runner, name)


class PoisonError(RuntimeError):
    """A forward refused by fault injection (`Faults.poison_token`)."""


class _PoisonModel:
    """The model's forward, raising when its input holds `faults.poison_token` (a request that
    deterministically breaks the forward). Under tensor parallelism it sits inside GroupGuard, on
    rank 0, before the step reaches the workers: the guard sees a forward fail with every rank alive."""

    def __init__(self, model, faults: Faults):
        self._model = model
        self._faults = faults

    def __call__(self, input_ids, *args, **kwargs):
        token = self._faults.poison_token
        if token is not None and bool((input_ids == token).any()):
            self._faults.poisoned += 1
            raise PoisonError(f"fault injection: the forward's input holds poison token {token}")
        return self._model(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def install(engine, transport) -> Faults:
    """Wrap this replica's runner, model and NIXL agent; returns the switches."""
    from cluster.serving.tensor_parallel import GroupGuard  # noqa: PLC0415

    faults = Faults()
    guard = engine.runner.model
    if isinstance(guard, GroupGuard):  # inside the guard: a poison forward is the group's failure
        guard.wrap_model(lambda model: _PoisonModel(model, faults))
    else:
        engine.runner.model = _PoisonModel(engine.runner.model, faults)
    engine.runner = _SlowRunner(engine.runner, faults)
    transport.agent = _FaultyAgent(transport.agent, faults)
    make_sender = transport.notice_sender
    transport.notice_sender = lambda name: _FaultyNotices(make_sender(name), faults)
    return faults
