"""A replica's health as Serve asks for it (cluster/serving/replica.py's check_health): its loop
alive and making progress, a tensor-parallel replica's ranks whole, its engine's steps not failing
in a row."""

from __future__ import annotations

import time


class ReplicaHealth:
    def __init__(self, pool: str, engine, loop, ranks, stuck_loop_s: float, max_consecutive_step_errors: int):
        self.pool, self.engine, self.loop, self.ranks = pool, engine, loop, ranks
        self.stuck_loop_s = stuck_loop_s
        self.max_consecutive_step_errors = max_consecutive_step_errors

    def check(self) -> None:
        """Raise (RuntimeError, saying why) when the replica should be replaced."""
        if not self.loop.is_alive():
            raise RuntimeError(f"{self.pool} engine loop is not running")
        stalled = self.loop.stalled_for(time.monotonic())
        if stalled > self.stuck_loop_s:
            raise RuntimeError(f"{self.pool} engine loop has made no progress for {stalled:.1f} s "
                               f"(stuck_loop_s {self.stuck_loop_s:g})")
        lost = self.ranks.lost() if self.ranks is not None else None
        if lost is not None:  # a tensor-parallel replica is whole or dead
            raise RuntimeError(f"{self.pool} engine: {lost}")
        failed = self.engine.stats.consecutive_step_errors  # an int the loop thread writes: read as is
        if failed >= self.max_consecutive_step_errors:
            raise RuntimeError(f"{self.pool} engine: the last {failed} steps failed "
                               f"(max_consecutive_step_errors {self.max_consecutive_step_errors})")
