"""Drives one run on a single asyncio loop: sessions start at their arrival offsets, at most
`max_concurrency` requests are in flight (the rest wait on the client, and that wait is recorded),
the turns of a session run one after another, and the whole run stops at `duration_s`: nothing
new starts after it and requests still streaming then are cancelled and counted as incomplete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from cluster.tools.loadgen.clients import Answer, Client
from cluster.tools.loadgen.datasets import Prompt, Session, Turn
from cluster.tools.loadgen.records import RequestRecord

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    records: list[RequestRecord]  # in the order they were sent
    started_at: float  # perf_counter at the run's start (arrival offsets count from here)
    duration_s: float  # start -> last request done, or the time bound
    planned: int  # requests the sessions hold
    hit_time_bound: bool
    client_cpu_s: float = 0.0  # CPU time this process (the load generator) used during the run
    loop_lags_s: list[float] = field(default_factory=list)  # how late the client's loop woke a 10 ms ticker

    @property
    def not_sent(self) -> int:
        """Planned requests never sent: due after the time bound, or after a failed turn."""
        return self.planned - len(self.records)

    @property
    def client_cpu_share(self) -> float:
        """The load generator's CPU use over the run, in cores (1.0 = one core busy throughout)."""
        return self.client_cpu_s / self.duration_s if self.duration_s > 0 else 0.0

    def send_lag_s(self, p: float) -> float:
        """Percentile p of how late requests left after they were due: the client's own delay (with
        a concurrency cap, also the deliberate wait for a free slot)."""
        lags = sorted(r.queue_s for r in self.records)
        return lags[min(len(lags) - 1, int(p / 100 * len(lags)))] if lags else 0.0

    def loop_lag_s(self, p: float) -> float:
        """Percentile p of the client loop's own delay: every latency the client measured may be
        late by this much (a response sits in the socket until the loop gets to it)."""
        lags = sorted(self.loop_lags_s)
        return lags[min(len(lags) - 1, int(p / 100 * len(lags)))] if lags else 0.0

    def kept_up(self, max_lag_s: float = 0.05) -> bool:
        """False when an open-loop load generator fell behind: p99 send lag or p99 loop lag over
        `max_lag_s`. Then the offered rate was not what was planned, or the latencies it took
        include its own queue, and the run proves nothing."""
        return self.send_lag_s(99) <= max_lag_s and self.loop_lag_s(99) <= max_lag_s


def answer_as_prompt(prompt: Prompt, answer: Answer) -> Prompt:
    """The answer in the prompt's form, to extend a conversation."""
    if prompt.token_ids is not None:
        if answer.token_ids is None:
            raise ValueError("this API streams text only: multi-turn token-id sessions need the gRPC backend")
        return Prompt(token_ids=answer.token_ids)
    return Prompt(text=answer.text)


class Runner:
    def __init__(self, client: Client, max_concurrency: int | None = None, progress: bool = True):
        self.client = client
        self.max_concurrency = max_concurrency
        self.progress = progress

    def _limit(self):
        return asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else contextlib.nullcontext()

    async def warmup(self, turns: Sequence[Turn]) -> list[RequestRecord]:
        """Send `turns` as independent requests (all due at once, under the concurrency cap)."""
        limit = self._limit()

        async def one(i: int, turn: Turn) -> RequestRecord:
            rec = RequestRecord(i, i, 0, time.perf_counter(), turn.max_tokens, turn.prompt.num_tokens)
            async with limit:
                await self.client.generate(turn.prompt, rec)
            return rec

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(turns))))

    async def run(self, sessions: Sequence[Session], offsets: Sequence[float], duration_s: float) -> RunOutcome:
        from tqdm import tqdm  # noqa: PLC0415

        planned = sum(s.num_requests for s in sessions)
        records: list[RequestRecord] = []
        limit = self._limit()
        bar = tqdm(total=planned, disable=not self.progress, unit="req", desc="pdserve bench")
        tasks: list[asyncio.Task] = []
        started = time.perf_counter()
        cpu_started = time.process_time()
        end = started + duration_s
        loop_lags: list[float] = []

        async def ticker(period_s: float = 0.01) -> None:
            while True:
                due = time.perf_counter() + period_s
                await asyncio.sleep(period_s)
                loop_lags.append(max(0.0, time.perf_counter() - due))

        tick = asyncio.create_task(ticker())
        async def session(sid: int, s: Session, due: float) -> None:
            context: Prompt | None = None
            for k, turn in enumerate(s.turns):
                prompt = turn.prompt if context is None else context + turn.prompt
                rec = RequestRecord(-1, sid, k, due, turn.max_tokens, prompt.num_tokens)
                async with limit:
                    rec.index = len(records)
                    records.append(rec)
                    try:
                        answer = await self.client.generate(prompt, rec)
                    except Exception as e:  # noqa: BLE001 — a client-side failure fails the request, not the run
                        log.exception("request %d failed on the client", rec.index)
                        rec.fail("CLIENT_ERROR", f"{type(e).__name__}: {e}")
                        answer = None
                bar.update(1)
                if answer is None:
                    return  # a failed turn ends its session
                if k + 1 < len(s.turns):
                    context = prompt + answer_as_prompt(prompt, answer)
                due = time.perf_counter()

        async def dispatch() -> None:
            for sid, (s, offset) in enumerate(zip(sessions, offsets)):
                due = started + offset
                if due >= end:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(session(sid, s, due)))

        try:
            await asyncio.wait_for(dispatch(), timeout=max(0.0, end - time.perf_counter()))
        except asyncio.TimeoutError:
            pass
        pending: set[asyncio.Task] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, end - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = min(time.perf_counter(), end) - started
        tick.cancel()
        bar.close()
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
        if errors:  # a bug in the load generator, not a failed request: stop loudly
            raise errors[0]
        for rec in records:
            if rec.status == "pending":
                rec.status = "incomplete"
        return RunOutcome(records, started, duration, planned, hit_time_bound=bool(pending) or len(tasks) < len(sessions),
                          client_cpu_s=time.process_time() - cpu_started, loop_lags_s=loop_lags)
