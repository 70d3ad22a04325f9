"""The ledger's files: a snapshot (`ledger.json`) and an append-only journal beside it
(`ledger.json.journal`), one JSON line per change.

A change is durable once its line is written and the journal fsynced: one write and one fsync for
every batch of changes (the actor's group commit), whatever the ledger's size. When the journal
passes its bound (`compact_bytes`, at least twice the last snapshot's size, so the rewrite costs
O(1) a change amortized) the whole state is written as a new snapshot (tmp + fsync + rename +
directory fsync) carrying the seq of the last change it holds, and the journal is emptied.

Reading back: the snapshot, then every journal line whose seq is past the snapshot's. A crash
between the snapshot's rename and the journal's truncation leaves lines the snapshot already holds:
skipped by their seq. A crash mid-write leaves a torn last line (no newline, or bytes that do not
parse): dropped, and cut off the file before the next append so the journal never holds a line
glued to garbage. A bad line anywhere else, or a gap in the seqs, is corruption: refused, naming
the file and the line. Reading never writes (so `pdserve budget --file` may read a live ledger)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from router.ingress.gateway.audit_log import fsync_dir

COMPACT_BYTES = 1 << 20  # the journal's least bound before a snapshot


class Journal:
    def __init__(self, path: str | Path, compact_bytes: int = COMPACT_BYTES):
        self.path = Path(path)
        self.journal = self.path.with_name(self.path.name + ".journal")
        self.compact_bytes = compact_bytes
        self.size = 0  # bytes of good lines in the journal
        self._snapshot_bytes = 0
        self._torn = False  # the file holds a torn tail past `size`: cut before the next append

    def load(self) -> tuple[dict | None, list[dict]]:
        """The snapshot (None: none yet) and the journal's records past it, in order."""
        snapshot = None
        if self.path.exists():
            text = self.path.read_text()
            snapshot, self._snapshot_bytes = json.loads(text), len(text)
        seq = snapshot.get("seq", 0) if snapshot else 0
        raw = self.journal.read_bytes() if self.journal.exists() else b""
        lines = raw[:raw.rfind(b"\n") + 1].split(b"\n")[:-1]  # what follows the last newline is torn
        records, good = [], 0
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:
                    break  # the last line is garbage (a crash mid-write): torn too
                raise ValueError(f"budgets.ledger_path: {self.journal} line {i + 1} is corrupt "
                                 f"(not the last line, so not a torn write): {line[:80]!r}") from None
            good += len(line) + 1
            if record["seq"] <= seq:
                continue  # the snapshot holds it (a crash between a snapshot and the journal's truncation)
            if record["seq"] != seq + 1:
                raise ValueError(f"budgets.ledger_path: {self.journal} line {i + 1} has seq {record['seq']}, "
                                 f"expected {seq + 1}: records are missing")
            seq = record["seq"]
            records.append(record)
        self.size, self._torn = good, good < len(raw)
        return snapshot, records

    def append(self, lines: list[str]) -> None:
        """One write and one fsync. A failure leaves the file as it was (cut back) and raises."""
        if not lines:
            return
        data = "".join(line + "\n" for line in lines).encode()
        created = not self.journal.exists()
        if created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.journal, "ab") as f:
            try:
                if self._torn:
                    f.truncate(self.size)
                    self._torn = False
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(self.size)
                raise
        if created:
            fsync_dir(self.journal.parent)
        self.size += len(data)

    def over_bound(self) -> bool:
        return self.size > max(self.compact_bytes, 2 * self._snapshot_bytes)

    def compact(self, data: str) -> None:
        """`data` (the whole state, with the seq of its last change) becomes the snapshot, then
        the journal is emptied."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._snapshot_bytes = len(data)
        if self.journal.exists():
            with open(self.journal, "r+b") as f:
                f.truncate(0)
                os.fsync(f.fileno())
        self.size, self._torn = 0, False
