"""Which replica holds which KV blocks: a plain class, fed by the replicas' block events.

Each replica sends batches of stored/removed block-hash events with a sequence number that grows by one
per batch (its device pool's, "+" / "-", and its lower tiers': "+1" / "-1" for the host tier, "+2" /
"-2" for disk, so a prefix pushed down to host memory still counts, at its tier's weight), and an incarnation id that changes when the replica restarts. A batch that does not
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
    hashes: set[BlockHash] = field(default_factory=set)  # its device pool's
    tiers: dict[int, set[BlockHash]] = field(default_factory=dict)  # level (1 host, 2 disk) -> hashes


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
            elif kind == "-":
                self._drop(replica_id, r, h)
            elif kind[0] == "+":
                r.tiers.setdefault(int(kind[1:]), set()).add(h)
            else:
                r.tiers.get(int(kind[1:]), set()).discard(h)
        r.seq = seq
        return True

    def resync(self, replica_id: str, incarnation: str, seq: int, hashes: Iterable[BlockHash],
               tiers: Sequence[Iterable[BlockHash]] = ()) -> None:
        """Replace everything known about a replica with its full snapshot as of `seq` (its device
        pool's hashes, and each lower tier's, top down)."""
        self.forget(replica_id)
        r = self._replicas[replica_id] = _Replica(incarnation, seq)
        for h in hashes:
            r.hashes.add(h)
            self._where.setdefault(h, set()).add(replica_id)
        r.tiers = {level: set(t) for level, t in enumerate(tiers, start=1)}

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

    def prefix_tiers(self, hashes: Sequence[BlockHash], candidates: Iterable[str]) -> dict[str, tuple[int, tuple[int, ...]]]:
        """For each candidate, what its engine would find for `hashes`, as its KV cache looks up a
        prompt: the leading blocks in its device pool, then the blocks after them that a lower
        tier holds (the tier's level each, 1 host, 2 disk), up to the first block held nowhere."""
        cands = list(candidates)
        device = self.prefix_blocks(hashes, cands)
        out = {}
        for c in cands:
            r = self._replicas.get(c)
            levels: list[int] = []
            if r is not None and r.tiers:
                ordered = sorted(r.tiers.items())
                for h in hashes[device[c]:]:
                    level = next((lv for lv, held in ordered if h in held), None)
                    if level is None:
                        break
                    levels.append(level)
            out[c] = (device[c], tuple(levels))
        return out

    def check_invariants(self) -> None:
        for h, holders in self._where.items():
            assert holders, f"empty holder set for {h.hex()}"
            for rid in holders:
                assert h in self._replicas[rid].hashes, (rid, h.hex())
        for rid, r in self._replicas.items():
            for h in r.hashes:
                assert rid in self._where.get(h, ()), (rid, h.hex())
