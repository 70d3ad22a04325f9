"""Which replica holds which KV blocks: a plain class, fed by the replicas' block events.

Each replica sends batches of stored/removed block-hash events with a sequence number that grows by one
per batch, and an incarnation id that changes when the replica restarts. A batch that does not
follow the last one (a gap, or a new incarnation) is refused: the caller must then resync that
replica from a full snapshot of its cached hashes. A dead replica is forgotten at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from cluster.engine.kv_cache.hashing import BlockHash


@dataclass
class _Replica:
    incarnation: str
    seq: int
    hashes: set[BlockHash] = field(default_factory=set)


class PrefixIndex:
    def __init__(self):
        self._where: dict[BlockHash, set[str]] = {}
        self._replicas: dict[str, _Replica] = {}

    def replicas(self) -> list[str]:
        return sorted(self._replicas)

    def hashes(self, replica_id: str) -> set[BlockHash]:
        r = self._replicas.get(replica_id)
        return set() if r is None else set(r.hashes)

    def num_blocks(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return 0 if r is None else len(r.hashes)

    def apply(
        self, replica_id: str, incarnation: str, seq: int, events: Iterable[tuple[str, BlockHash]],
    ) -> bool:
        """Apply one batch of ("+" | "-", hash) events, in order (a hash can be stored, evicted
        and stored again within one batch). False (nothing applied) means: resync this replica."""
        r = self._replicas.get(replica_id)
        if r is None or r.incarnation != incarnation or seq != r.seq + 1:
            return False
        for kind, h in events:
            if kind == "+":
                r.hashes.add(h)
                self._where.setdefault(h, set()).add(replica_id)
            else:
                self._drop(replica_id, r, h)
        r.seq = seq
        return True

    def resync(self, replica_id: str, incarnation: str, seq: int, hashes: Iterable[BlockHash]) -> None:
        """Replace everything known about a replica with its full snapshot as of `seq`."""
        self.forget(replica_id)
        r = self._replicas[replica_id] = _Replica(incarnation, seq)
        for h in hashes:
            r.hashes.add(h)
            self._where.setdefault(h, set()).add(replica_id)

    def forget(self, replica_id: str) -> None:
        r = self._replicas.pop(replica_id, None)
        if r is None:
            return
        for h in r.hashes:
            holders = self._where.get(h)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._where[h]

    def _drop(self, replica_id: str, r: _Replica, h: BlockHash) -> None:
        r.hashes.discard(h)
        holders = self._where.get(h)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._where[h]

    def prefix_blocks(self, hashes: Sequence[BlockHash], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate, how many leading blocks of `hashes` it holds (chained hashes: a
        block is only useful if every block before it is there too)."""
        result = {c: 0 for c in candidates}
        alive = set(result)
        for i, h in enumerate(hashes):
            holders = self._where.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for c in alive:
                result[c] = i + 1
        return result

    def check_invariants(self) -> None:
        for h, holders in self._where.items():
            assert holders, f"empty holder set for {h.hex()}"
            for rid in holders:
                assert h in self._replicas[rid].hashes, (rid, h.hex())
        for rid, r in self._replicas.items():
            for h in r.hashes:
                assert rid in self._where.get(h, ()), (rid, h.hex())
