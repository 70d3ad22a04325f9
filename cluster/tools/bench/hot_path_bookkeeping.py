"""Per-call cost of the bookkeeping issue 53 weighed on the hot paths (timeit, min of 7 rounds of
a million calls, less an empty call's):

    python -m cluster.tools.bench.hot_path_bookkeeping

the replica's `routed` counter on every call (kept), and the two measures taken off (the poll's
per-pull phases, now MeasuredTransport's; the static step's replay_events branch, now ReplayTimer's)."""

from __future__ import annotations

import time
import timeit

from cluster.serving.replica import EngineReplica
from kv_transfer.transport import PendingPull

N = 1_000_000


def best(f) -> float:
    return min(timeit.timeit(f, number=N) for _ in range(7)) / N * 1e9



r = object.__new__(EngineReplica)
r.replica_id, r.routed = "decode-abc", {"on_target": 0, "off_target": 0}
empty = best(lambda: None)
print(f"empty call {empty:.1f} ns")
print(f"arrived(named) {best(lambda: r.arrived('decode-abc')) - empty:.1f} ns over an empty call")
print(f"arrived(None)  {best(lambda: r.arrived(None)) - empty:.1f} ns")
pull = PendingPull("r", "p", "a", None, 1, 1, 1, 0.0, 1.0)
def old_poll_bookkeeping(p=pull):
    if not p.polls:
        p.first_poll = time.monotonic()
    p.polls += 1


print(f"poll's old bookkeeping (the measures MeasuredTransport now keeps) {best(old_poll_bookkeeping) - empty:.1f} ns a poll")


class S:
    replay_events = None


s = S()

def old_branch(s=s):
    if s.replay_events is None:
        pass


print(f"static step's old replay_events branch {best(old_branch) - empty:.1f} ns a step")
