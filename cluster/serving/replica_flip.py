"""A replica's flip between roles (cluster/serving/replica.py's set_role): drain, swap, re-register.
One flip at a time; the drain and the swap run on the loop thread, the waits around them on Serve's
event loop."""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.errors import DrainTimeoutError, WrongReplicaError
from cluster.serving.replica_role import PlayedRole, Role
from router.cells import cell_router

log = logging.getLogger("cluster.serving.replica")  # the replica's own logger: its flip lines stay where they were

DRAIN_POLL_S = 0.05  # a draining replica checks its old role this often
ROUTER_ACK_S = 5.0  # the longest a flip waits for the router to take one of its reports


class RoleFlip:
    """`rank`: the replica's Serve rank, which places it in a cell whatever role it plays (None: not
    a Serve replica; its role's hash places it: router/cells.py replica_cell)."""

    def __init__(self, replica_id: str, played: PlayedRole, loop, reporter, app: str, rank: int | None = None):
        self.replica_id, self.played, self.loop, self.reporter = replica_id, played, loop, reporter
        self.app = app  # its Serve app: whose routers (cells) it feeds
        self.rank = rank
        self._lock = asyncio.Lock()  # one flip (or move to a new rank's cell) at a time

    async def reranked(self, rank: int | None) -> bool:
        """Serve gave this replica a new rank (after a downscale it re-ranks the replicas above the
        new count into the holes): from now on it feeds its new rank's cell (RouterFeed.move; the
        old cell's router forgets it). False: the same rank, or the same cell (nothing moved)."""
        if rank is None or rank == self.rank:
            return False
        async with self._lock:
            self.rank = rank
            if self.reporter.feed is None:
                return False
            router = await asyncio.to_thread(cell_router, self.played.config, self.app, self.played.name,
                                             self.replica_id, rank)  # GCS calls: off Serve's loop
            moved = await self.loop.call(lambda: self.reporter.feed.move(router))
            if moved:
                log.info("replica %s: rank %d, feeds %s", self.replica_id, rank, getattr(router, "name", router))
            return moved

    async def set_role(self, role: Role, drain_timeout_s: float, target_replica: str | None) -> dict:
        """EngineReplica.set_role's body (its docstring says what a flip keeps and moves)."""
        if target_replica is not None and target_replica != self.replica_id:
            # Serve's request router falls back to a random live replica when the target is gone:
            # flipping that one instead would move the wrong replica and report success
            raise WrongReplicaError(f"set_role({role!r}) named replica {target_replica} but reached replica "
                                    f"{self.replica_id}; nothing was changed")
        if role not in self.played.specs:
            raise ValueError(f"replica {self.replica_id} cannot play {role!r} (it knows {sorted(self.played.specs)})")
        async with self._lock:
            started = time.monotonic()
            old = self.played.name
            if role == old:
                return self._flipped(old, role, 0.0, 0)
            drained_requests, ack = await self.loop.call(lambda: self._drain(True))
            try:
                await self._acked(ack)  # from here no decision names this replica
                while True:
                    swapped, ack = await self.loop.call(lambda: self._swap(role))
                    if swapped:
                        break
                    if time.monotonic() - started >= drain_timeout_s:
                        raise DrainTimeoutError(
                            f"replica {self.replica_id} still held {old} work after {drain_timeout_s:g} s "
                            f"of drain; it stays {old}")
                    await asyncio.sleep(DRAIN_POLL_S)
            except BaseException:
                _, ack = await self.loop.call(lambda: self._drain(False))
                await self._acked(ack)
                raise
            await self._acked(ack)
            log.info("replica %s flipped %s -> %s after %.2f s of drain (%d requests)",
                     self.replica_id, old, role, time.monotonic() - started, drained_requests)
            return self._flipped(old, role, time.monotonic() - started, drained_requests)

    def _flipped(self, old: Role, new: Role, drained_s: float, drained_requests: int) -> dict:
        return {"replica_id": self.replica_id, "from": old, "to": new, "drained_s": round(drained_s, 4),
                "drained_requests": drained_requests}

    def _drain(self, on: bool):
        """Loop thread: start (or call off) a drain; (the old role's requests, the report's call)."""
        self.reporter.draining = on
        return self.played.obj.in_flight(), self.reporter.push(time.monotonic())

    def _swap(self, role: Role):
        """Loop thread: if the old role holds nothing, the new one takes over; (swapped, the report's call)."""
        if not self.played.obj.drained():
            return False, None
        spec = self.played.swap(role)
        self.loop.replace_core(self.played.obj, spec.idle_poll_s, getattr(self.played.config, role).stream_interval)
        self.reporter.flipped(role)
        if self.reporter.feed is not None:  # with cells and no rank, the new role's cell (router/cells.py)
            self.reporter.feed.move(cell_router(self.played.config, self.app, role, self.replica_id, self.rank))
        return True, self.reporter.push(time.monotonic())

    async def _acked(self, ack) -> None:
        """Wait (bounded) until the router has the report: after a drain's, no new decision names
        this replica. A router that is down or slow delays nothing: a call a stale decision sends
        here anyway is served during the drain, or refused (WrongRoleError) after the swap."""
        if ack is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(ack), ROUTER_ACK_S)
        except Exception as e:  # noqa: BLE001
            log.warning("replica %s: the router did not take its report within %g s: %r",
                        self.replica_id, ROUTER_ACK_S, e)
