"""Shadow traffic (issue 18): a fraction of a model's requests is also run on a candidate version, and
what the candidate answers is compared with what the client got, counted, and dropped.

A mirror is isolated from production:
- it never reaches the client: the client's stream is the primary's alone, and a mirror's outcome
  is settled in the background after the client's last delta;
- it is never counted against the tenant: no admission slot, rate or token quota, no budget, no
  response cache (it has an audit record of its own, with its outcome and no text: `audit`); it runs under its own tenant name (`shadow`) at batch
  priority, so every engine admits waiting interactive work before it;
- it is shed first: past `max_inflight` mirrors on this ingress, or when the ingress is at half
  its in-flight cap, or when the candidate's replica refuses it (queue full), it is dropped and
  counted as shed. A request with n > 1 choices is not mirrored.

Outcomes, per model and candidate version: `same` (the candidate's text equals the client's),
`different`, `failed` (the candidate erred, or the primary did, so there is nothing to compare),
`shed`. Greedy requests make `different` a regression signal; sampled ones differ by nature.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from dataclasses import replace
from typing import AsyncIterator, Callable

from cluster.engine.request import Priority, RequestContext
from cluster.engine.sampling_params import SamplingParams
from router.ingress.flow.request_flow import RequestFlow
from router.ingress.request import ClientRequest, Delta
from router.ingress.status import Rejected

log = logging.getLogger(__name__)

SHADOW_TENANT = "shadow"
OUTCOMES = ("same", "different", "failed", "shed")


class ShadowRunner:
    def __init__(self):
        self.inflight: Counter[str] = Counter()  # model -> mirrors running
        self.outcomes: Counter[tuple[str, str, str]] = Counter()  # (model, version, outcome) -> requests
        self._tasks: set[asyncio.Task] = set()
        # (candidate, request, mirror's id, outcome) -> its audit record (FrontDoor.audit_mirror, with audit on)
        self.audit: Callable[[RequestFlow, ClientRequest, str, str], None] | None = None

    def count(self, flow: RequestFlow, outcome: str) -> None:
        self.outcomes[flow.config.model_name, flow.config.version or "", outcome] += 1

    def mirror(self, primary: AsyncIterator[Delta], candidate: RequestFlow, max_inflight: int, request: ClientRequest,
               sampling: SamplingParams, ctx: RequestContext, busy: Callable[[], bool]) -> AsyncIterator[Delta]:
        """The primary's deltas, unchanged. The candidate starts with the primary's first delta
        (a request refused or failed before it is not mirrored), or is shed then. `ctx`: what the
        tenant's request would be scheduled by; `busy()`: the ingress is too loaded to mirror."""
        def start() -> asyncio.Future | None:
            model = candidate.config.model_name
            if self.inflight[model] >= max_inflight or busy():
                self.count(candidate, "shed")
                return None
            self.inflight[model] += 1  # until settled (counted), so a scrape never sees it half done
            mirror_ctx = replace(ctx, tenant=SHADOW_TENANT, priority=Priority.BATCH)
            return asyncio.ensure_future(self._candidate(candidate, request, sampling, mirror_ctx, rid))

        rid = uuid.uuid4().hex
        return self._watch(primary, candidate, start, lambda outcome: self.audit and self.audit(
            candidate, request, rid, outcome))

    async def _candidate(self, flow: RequestFlow, request: ClientRequest, sampling: SamplingParams,
                         ctx: RequestContext, rid: str) -> str:
        req = await flow.prepare(rid, request, sampling)
        text = []
        async for d in flow.run(rid, rid, req.prompt_token_ids, sampling, ctx):
            text.append(d.text)
        return "".join(text)

    async def _watch(self, primary: AsyncIterator[Delta], candidate: RequestFlow, start,
                     audit: Callable[[str], None]) -> AsyncIterator[Delta]:
        text, finished, run, started = [], False, None, False
        try:
            async for d in primary:
                if not started:
                    started, run = True, start()
                text.append(d.text)
                finished = finished or d.finish_reason is not None
                yield d
        finally:
            if run is not None:
                if not finished:  # the primary failed or the client left: nothing to compare
                    run.cancel()
                self._settle(candidate, run, "".join(text) if finished else None, audit)

    def _settle(self, candidate: RequestFlow, run: asyncio.Future, served: str | None,
                audit: Callable[[str], None]) -> None:
        """Count the mirror's outcome once it ends (off the client's path: its stream is complete)."""
        async def settle():
            try:
                got = await run
            except Rejected:
                outcome = "shed"  # the candidate's replica refused it
            except BaseException as e:  # noqa: BLE001 — a mirror's failure is counted, never raised
                log.debug("shadow request to %s failed: %r", candidate.group, e)
                outcome = "failed"
            else:
                outcome = "failed" if served is None else "same" if got == served else "different"
            self.count(candidate, outcome)
            self.inflight.subtract([candidate.config.model_name])
            audit(outcome)

        self._tasks.add(task := asyncio.ensure_future(settle()))
        task.add_done_callback(self._tasks.discard)
