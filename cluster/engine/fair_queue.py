"""The waiting queue: priority classes, then weighted fair queueing across tenants.

Order of admission:
  1. priority class: every waiting INTERACTIVE request goes before any BATCH one;
  2. within a class, the backlogged tenant with the smallest virtual time goes next
     (start-time fair queueing: a tenant's virtual time advances by tokens / weight for every
     token the scheduler runs for it, prefill or decode);
  3. within a tenant, first come first served (a preempted request goes back to the front).

A tenant that was idle re-enters at the smallest virtual time among the backlogged tenants,
so idling earns no credit and a returning tenant cannot starve the others. With one tenant
this is exactly FCFS. Plain Python, no clock: the scheduler calls `charge`.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from cluster.engine.request import Request, RequestContext


class FairQueue:
    def __init__(self):
        self._queues: dict[tuple[int, str], deque[Request]] = {}  # (priority, tenant) -> FIFO
        self._vtime: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # tenant -> its waiting requests, all classes
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def append(self, req: Request) -> None:
        self._queue_for(req).append(req)

    def appendleft(self, req: Request) -> None:
        """Back to the front of its tenant's queue (a preempted request)."""
        self._queue_for(req).appendleft(req)

    def remove(self, req: Request) -> None:
        q = self._queues[(req.ctx.priority, req.ctx.tenant)]
        if q and q[0] is req:
            q.popleft()
        else:
            q.remove(req)
        self._len -= 1
        self._backlog[req.ctx.tenant] -= 1

    def peek(self, skip: set[str] | frozenset[str] = frozenset()) -> Request | None:
        """The request to admit next, ignoring tenants in `skip` (e.g. over their KV budget)."""
        best, best_key = None, None
        for (priority, tenant), q in self._queues.items():
            if not q or tenant in skip:
                continue
            key = (priority, self._vtime[tenant], q[0].arrival_time)
            if best_key is None or key < best_key:
                best, best_key = q[0], key
        return best

    def charge(self, ctx: RequestContext, tokens: int) -> None:
        self._vtime[ctx.tenant] = self._vtime.get(ctx.tenant, 0.0) + tokens / ctx.weight

    def virtual_time(self, tenant: str) -> float:
        return self._vtime.get(tenant, 0.0)

    def _queue_for(self, req: Request) -> deque[Request]:
        tenant = req.ctx.tenant
        key = (req.ctx.priority, tenant)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
        if not self._backlog.get(tenant):  # it becomes backlogged: no credit for the time it was idle
            floor = min((self._vtime[t] for t, n in self._backlog.items() if n), default=None)
            own = self._vtime.get(tenant, 0.0)
            self._vtime[tenant] = own if floor is None else max(own, floor)
        self._backlog[tenant] = self._backlog.get(tenant, 0) + 1
        self._len += 1
        return q
