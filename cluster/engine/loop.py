"""The engine loop: async streaming over a synchronous engine core, one background thread.

A core is anything with `step() -> outputs`, `has_unfinished()` and `abort(request_id)` (and
optionally `service()`, run every iteration, idle or not): the plain LLMEngine, the prefill role,
the decode role. Outputs carry `request_id` and `finished`. Hooks (`LoopHook`: load reports, the
router's event feed, telemetry) are called by the loop after each step and each turn; they observe
the engine, they do not wrap it, and a failing hook is logged and never stops the loop.

Callers `async for` over `stream(...)` and receive each step's outputs as they are produced. The
core is touched only by the loop thread; callers hand it work as closures. Leaving the iterator
early (client disconnect, task cancelled) aborts the request, which frees its blocks. The loop
also times each stream's first output (`first_outputs`): replicas report it as TTFT.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from cluster.engine.latency import FirstOutputTimer
from cluster.engine.outputs import FinishReason, RequestOutput
from cluster.engine.priority import lower_thread_priority
from cluster.errors import ErrorKind
from cluster.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    request_id: str | None = None  # set: register this stream's sink before running fn
    sink: asyncio.Queue | None = None


class LoopHook(Protocol):
    """Called on the loop thread: `after_step` after every engine step, `service` once every
    turn (busy or idle) after the core's own service."""

    def after_step(self, now: float) -> None: ...

    def service(self, now: float, busy: bool) -> None: ...


AUTO_STREAMS_PER_TOKEN = 8  # stream_interval "auto": one more token per message per this many streams
AUTO_MAX_INTERVAL = 8  # ... up to this many tokens per message


def chunk_tokens(stream_interval: int | str, streams: int) -> int:
    """Tokens a streamed message carries (after the first, which goes alone at once).

    Every message costs the same whatever it carries: the replica's yield, Ray's object, the
    ingress's relay and the client protocol's frame. One token per message is right for a few
    streams; with hundreds, those per-message costs outgrow the model's step and starve the event
    loops that admit and relay (measured: issue 15's burst, docs/benchmarks.md). "auto" sends one
    token per message up to AUTO_STREAMS_PER_TOKEN streams on the replica, then one more per as
    many again, up to AUTO_MAX_INTERVAL: the messages per step stay about flat as streams grow,
    and a stream's tokens arrive at most that many steps late. An int fixes it (vLLM's
    --stream-interval)."""
    if stream_interval == "auto":
        return min(AUTO_MAX_INTERVAL, max(1, -(-streams // AUTO_STREAMS_PER_TOKEN)))
    return int(stream_interval)


class EngineLoop:
    def __init__(self, core, idle_poll_s: float | None = None, name: str = "pdserve-engine",
                 hooks: Sequence[LoopHook] = (), nice: int = 0, stream_interval: int | str = 1):
        self.core = core
        self.nice = nice  # the loop thread's OS niceness: its compute yields to the process's event loop
        self.stream_interval = stream_interval  # tokens per merged message: chunk_tokens
        self.engine = getattr(core, "engine", core)  # the LLMEngine underneath
        self.idle_poll_s = idle_poll_s
        self.hooks = tuple(hooks)
        self.hook_errors = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._turn_started: float | None = None  # monotonic start of the loop turn in progress
        self.first_outputs = FirstOutputTimer()  # loop thread only: read it through call()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) ----------------------------------------------------------

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the loop thread between steps; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._send(_Call(fn, fut, loop))
        return await fut

    async def stream(
        self, request_id: str, submit: Callable[[], Any], merge: Callable[[Any, Any], Any] | None = None
    ) -> AsyncIterator[Any]:
        """Run `submit` on the loop thread, then yield the request's outputs until finished.

        With `merge`, outputs that queued up while the consumer was busy are merged into one, and
        after the first output a message waits until it carries `chunk_tokens` tokens (the end of
        the stream and a failure go at once).
        """
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        fut = loop.create_future()
        finished = False
        try:
            self._send(_Call(submit, fut, loop, request_id, sink))
            await fut  # submit's own errors (bad input, incompatible peer) surface here
            first = True
            while not finished:
                out = await sink.get()
                while merge is not None and not out.finished and not sink.empty():
                    out = merge(out, sink.get_nowait())
                if merge is not None and not first:
                    want = chunk_tokens(self.stream_interval, len(self._sinks))
                    while not out.finished and len(out.token_ids) < want:
                        out = merge(out, await sink.get())
                first = False
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
    ) -> AsyncIterator[Any]:
        """Plain engine: stream a request's deltas. Bad input raises before the first yield."""
        req = self.engine.make_request(request_id, prompt, prompt_token_ids, sampling)
        # closed with this generator, so leaving early aborts now (not when the event loop
        # finalizes the inner generator)
        async with aclosing(self.stream(request_id, lambda: self.engine.add(req))) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight are aborted (blocks freed), their streams left
        open: their callers are going away too (see the end of _run)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, call: _Call) -> None:
        self._commands.put(call)
        self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------------

    def stalled_for(self, now: float) -> float:
        """How long the current loop turn has been running (0 while idle): a stuck engine shows here."""
        started = self._turn_started
        return 0.0 if started is None else now - started

    def _run(self) -> None:
        lower_thread_priority(self.nice)
        try:
            self._turns()
        except BaseException:  # a bug outside the engine step: no stream may be left waiting
            log.exception("engine loop died; failing its requests")
            for out in self._fail_all("engine loop died"):
                self._deliver(out)
            raise
        # Shutting down (a drained replica at the end of its grace period): free the blocks of what
        # is left but end no stream. Those callers see the replica die with it and migrate the
        # requests; a "cancelled" finish would end their clients' streams instead.
        for rid in list(self._sinks):
            self.core.abort(rid)

    def replace_core(self, core, idle_poll_s: float | None, stream_interval: int | str) -> None:
        """Drive `core` from the next turn on (a replica's role flip). Loop thread only (inside a
        `call`), with no stream of the old core left: streams are keyed by request id, not core."""
        if getattr(core, "engine", core) is not self.engine:
            raise ValueError("a new core must drive the same engine")
        self.core, self.idle_poll_s, self.stream_interval = core, idle_poll_s, stream_interval

    def _turns(self) -> None:
        while not self._stop:
            self._turn_started = time.monotonic()
            self._drain_commands()
            service = getattr(self.core, "service", None)  # read every turn: a call may replace the core
            if service is not None:
                service()
            busy = self.core.has_unfinished()
            self._call_hooks("service", self._turn_started, busy)
            if not busy:
                self._turn_started = None
                self._wake.wait(self.idle_poll_s)
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception:  # the engine step already fails its own requests; this is a bug
                log.exception("engine loop error; failing all requests")
                self._count_step_error()
                outputs = self._fail_all("engine loop error")
            self._call_hooks("after_step", time.monotonic())
            for out in outputs:
                self._deliver(out)

    def _count_step_error(self) -> None:
        """A step that raised is a failed step too: counted where the replica's health reads step
        errors in a row, so an engine that raises every step is replaced, not left failing every
        request it is given. (A core without an LLMEngine underneath counts nothing.)"""
        count = getattr(self.engine, "count_step_error", None)
        if count is not None:
            count()

    def _call_hooks(self, name: str, *args) -> None:
        for hook in self.hooks:
            try:
                getattr(hook, name)(*args)
            except Exception:  # an observer's failure never stops the engine
                self.hook_errors += 1
                log.exception("loop hook %s.%s failed", type(hook).__name__, name)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call):
                self._run_call(cmd)
            else:
                self.first_outputs.forget(cmd[1])
                out = self.core.abort(cmd[1])
                if out is not None:
                    self._deliver(out)

    def _run_call(self, call: _Call) -> None:
        if call.request_id is not None:
            if call.request_id in self._sinks:
                err = ValueError(f"request_id {call.request_id!r} is already in flight")
                call.loop.call_soon_threadsafe(_settle, call.future, None, err)
                return
            self._sinks[call.request_id] = (call.sink, call.loop)
            self.first_outputs.start(call.request_id, time.monotonic())
        try:
            result, error = call.fn(), None
        except Exception as e:  # noqa: BLE001 — handed to the caller
            result, error = None, e
            if call.request_id is not None:
                self._sinks.pop(call.request_id, None)
                self.first_outputs.forget(call.request_id)
        try:
            call.loop.call_soon_threadsafe(_settle, call.future, result, error)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _deliver(self, out) -> None:
        entry = self._sinks.get(out.request_id)
        if entry is None:
            return
        self.first_outputs.output(out.request_id, time.monotonic())
        if out.finished:
            del self._sinks[out.request_id]
        sink, loop = entry
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    def _fail_all(self, why: str) -> list:
        outs = []
        for rid in list(self._sinks):
            try:
                out = self.core.abort(rid)
            except Exception:  # noqa: BLE001 — the core is broken: end the stream regardless
                log.exception("abort of %s failed", rid)
                out = None
            outs.append(_failed(rid, why, out))
        return outs


def _failed(request_id: str, why: str, aborted) -> RequestOutput:
    """A terminal error output for a stream whose engine failed around it."""
    n_prompt = getattr(aborted, "num_prompt_tokens", 0)
    n_out = getattr(aborted, "num_output_tokens", 0)
    return RequestOutput(request_id, [], "", True, FinishReason.ERROR, n_prompt, n_out, 0, why, ErrorKind.INTERNAL)


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
