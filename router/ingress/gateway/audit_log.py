"""The audit log on disk: append-only JSON lines, hash-chained across rotated files, and its check.

Each line is one record, a JSON object with sorted keys. The writer adds three fields:
    seq   the record's number in the whole log (0, 1, 2, ... across files)
    prev  the previous record's `hash` (64 zeros for seq 0; the first record of a rotated file
          carries the last hash of the file before it, so the chain runs through every file)
    hash  sha256 of the line's canonical JSON without `hash` (so it covers `prev`)
An edited record fails its own hash; a removed record breaks the next record's `prev` and `seq`;
`verify` names the first record that fails. A chain only proves the log was not changed after
the fact by someone who did not also rewrite every later hash: anchor the head (`verify` prints
it) somewhere else to close that gap.

Files are `audit-YYYYMMDD-SEQ.jsonl` (the UTC day of their first record, the seq it starts at);
a new file starts when the current one passes `max_file_bytes` or the day changes. Each batch is
written with one write() and made durable with one fsync() before `append` returns. A line cut
off by a crash mid-write was never acknowledged: `open` truncates it (its sender resends it).

Plain Python, no Ray: the writer actor (audit_actor.py) is a thin shell over `AuditLog`; the
`pdserve audit verify` command calls `verify`. The clock is injected.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

GENESIS = "0" * 64
PATTERN = "audit-*.jsonl"


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def record_hash(record: dict) -> str:
    """sha256 over the record's canonical JSON without its own `hash` field."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def log_files(directory: str | Path) -> list[Path]:
    """The log's files in chain order (by their starting seq)."""
    return sorted(Path(directory).glob(PATTERN), key=lambda p: int(p.stem.rsplit("-", 1)[1]))


def _day(t: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(t))


class AppendResult(NamedTuple):
    written: int  # new records, now durable
    duplicates: int  # request ids already in the log (a resend): skipped


class AuditLog:
    """The writer's side: chain head, dedup set and the current file. One instance per log
    directory, in one process (the writer actor): it is not safe for two writers."""

    def __init__(self, directory: str | Path, max_file_bytes: int = 64 * 2**20, dedup_window: int = 200_000,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(directory)
        self.max_file_bytes = max_file_bytes
        self.dedup_window = dedup_window
        self.clock = clock
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seen: OrderedDict[str, None] = OrderedDict()  # recent request ids, oldest first
        self.next_seq, self.head = 0, GENESIS
        self._file: Path | None = None
        self._fd: int | None = None
        self._size = 0
        self.fsyncs = 0  # batches made durable by this instance (the benchmark's writer calls)
        self._recover()

    # ---- start-up: the chain's head and the dedup window, from the log's tail ------------------

    def _recover(self) -> None:
        files = log_files(self.dir)
        if not files:
            return
        last = files[-1]
        data = last.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a batch cut off mid-line by a crash: never acknowledged, resent by its sender
            with open(last, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        tail: list[dict] = []
        for path in reversed(files):  # newest first, until the window is full
            lines = path.read_bytes().splitlines()
            tail[:0] = [json.loads(line) for line in lines if line]
            if len(tail) >= self.dedup_window:
                break
        for rec in tail[-self.dedup_window:]:
            self._seen[rec["request_id"]] = None
        if tail:
            self.next_seq, self.head = tail[-1]["seq"] + 1, tail[-1]["hash"]
        self._open(last)

    def _open(self, path: Path) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._file = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._size = os.fstat(self._fd).st_size

    def _rotate_if_due(self, now: float) -> None:
        if self._file is not None:
            day = self._file.stem.split("-")[1]
            if self._size < self.max_file_bytes and day == _day(now):
                return
        self._open(self.dir / f"audit-{_day(now)}-{self.next_seq:012d}.jsonl")
        dir_fd = os.open(self.dir, os.O_RDONLY)  # the new name is durable too
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # ---- appending -----------------------------------------------------------------------------

    def seen(self, request_id: str) -> bool:
        return request_id in self._seen

    def append(self, records: Iterable[dict]) -> AppendResult:
        """Chain, write and fsync the records whose request id is new; one write and one fsync per
        batch (per file, when the batch crosses a rotation). Durable when this returns."""
        now = self.clock()
        self._rotate_if_due(now)
        chunk: list[bytes] = []
        written = duplicates = 0
        for rec in records:
            rid = rec["request_id"]
            if rid in self._seen:
                duplicates += 1
                continue
            rec = {k: v for k, v in rec.items() if k not in ("seq", "prev", "hash")}
            rec["seq"], rec["prev"] = self.next_seq, self.head
            rec["hash"] = record_hash(rec)
            line = canonical(rec) + b"\n"
            chunk.append(line)
            self._size += len(line)
            self.next_seq, self.head = self.next_seq + 1, rec["hash"]
            self._remember(rid)
            written += 1
            if self._size >= self.max_file_bytes:  # the rest of the batch goes to the next file
                self._flush(chunk)
                chunk = []
                self._rotate_if_due(now)
        self._flush(chunk)
        return AppendResult(written, duplicates)

    def _flush(self, chunk: list[bytes]) -> None:
        if chunk:
            data = b"".join(chunk)
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
            self.fsyncs += 1

    def _remember(self, rid: str) -> None:
        self._seen[rid] = None
        if len(self._seen) > self.dedup_window:
            self._seen.popitem(last=False)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- verifying -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int
    files: int
    head: str
    error: str | None = None  # "<file>:<line>: record seq S (request_id R): what is wrong"


def _lines(files: list[Path]) -> Iterator[tuple[Path, int, bytes]]:
    for path in files:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                yield path, n, line


def verify(path: str | Path) -> VerifyResult:
    """Check the chain of a log directory (every file, in order) or of one file (its first
    record's `prev` is taken on trust). Stops at the first record that fails."""
    p = Path(path)
    files = log_files(p) if p.is_dir() else [p]
    if not files:
        return VerifyResult(False, 0, 0, GENESIS, f"{p}: no audit files ({PATTERN})")
    count, head, seq = 0, None, None
    for file, n, raw in _lines(files):
        where = f"{file}:{n}"
        if not raw.endswith(b"\n"):
            return VerifyResult(False, count, len(files), head or GENESIS, f"{where}: the last line is cut off")
        try:
            rec = json.loads(raw)
            label = f"record seq {rec['seq']} (request_id {rec['request_id']})"
        except (ValueError, KeyError, TypeError) as e:
            return VerifyResult(False, count, len(files), head or GENESIS, f"{where}: not a record ({e})")
        if head is None and p.is_dir() and (rec["seq"] != 0 or rec["prev"] != GENESIS):
            error = f"{where}: {label}: the log does not start at seq 0 (earlier records removed)"
        elif head is not None and rec["seq"] != seq + 1:
            error = f"{where}: {label}: expected seq {seq + 1} (a record is missing or out of order)"
        elif rec.get("hash") != record_hash(rec):
            error = f"{where}: {label}: its hash does not match its content (edited)"
        elif head is not None and rec["prev"] != head:
            error = (f"{where}: {label}: prev does not match the hash of record seq {seq} "
                     f"(a record before it was edited or removed)")
        else:
            error = None
        if error is not None:
            return VerifyResult(False, count, len(files), head or GENESIS, error)
        count, head, seq = count + 1, rec["hash"], rec["seq"]
    return VerifyResult(True, count, len(files), head or GENESIS)


def read_records(path: str | Path) -> Iterator[dict]:
    p = Path(path)
    for _, _, raw in _lines(log_files(p) if p.is_dir() else [p]):
        yield json.loads(raw)
