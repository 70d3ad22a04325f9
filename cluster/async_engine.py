"""Async streaming over the synchronous engine: one background thread runs the step loop.

Callers `async for` over `generate(...)` and receive each step's delta as it is produced. The
engine is touched only by the loop thread; callers hand it commands (add, abort) through a queue.
Leaving the iterator early (client disconnect, task cancelled) aborts the request, which frees
its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from cluster.engine import LLMEngine, RequestOutput
from cluster.request import Request
from cluster.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: Request
    sink: "asyncio.Queue[RequestOutput]"
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas. Bad input raises InvalidRequestError before the first yield."""
        req = self.engine.make_request(request_id, prompt, prompt_token_ids, sampling)
        sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._send(_Add(req, sink, asyncio.get_running_loop()))
        finished = False
        try:
            while not finished:
                out = await sink.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # the engine step already fails its own requests; this is a bug
                log.exception("engine loop error; failing all requests")
                outputs = self._fail_all()
            for out in outputs:
                self._deliver(out)
        for rid in list(self._sinks):
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(out)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add(cmd.request)
                except ValueError as e:  # duplicate request id
                    out = RequestOutput(cmd.request.request_id, [], "", True, "error",
                                        cmd.request.num_prompt_tokens, 0, 0, str(e))
                    cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, out)
                    continue
                self._sinks[cmd.request.request_id] = (cmd.sink, cmd.loop)
            else:
                out = self.engine.abort(cmd.request_id)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._sinks.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        sink, loop = entry
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    def _fail_all(self) -> list[RequestOutput]:
        from cluster.request import RequestStatus  # noqa: PLC0415

        outs = []
        for rid in list(self._sinks):
            req = self.engine.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            if req is not None:
                req.error = "engine loop error"
                outs.append(self.engine.final_output(req, [], ""))  # noqa: SLF001
        return outs
