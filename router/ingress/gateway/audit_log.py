"""The audit log on disk: append-only JSON lines, hash-chained across rotated files, anchored by a
HEAD file, and its check.

Each line is one record, a JSON object with sorted keys. The writer adds three fields:
    seq   the record's number in the whole log (0, 1, 2, ... across files)
    prev  the previous record's `hash` (64 zeros for seq 0; the first record of a rotated file
          carries the last hash of the file before it, so the chain runs through every file)
    hash  sha256 of the line's canonical JSON without `hash` (so it covers `prev`)
An edited record fails its own hash; a removed record breaks the next record's `prev` and `seq`;
`verify` names the first record that fails.

The chain alone cannot show that records were removed from its *end* (the last lines, or the
last file): what is left is still a whole chain. So the writer anchors the end: after each
durable batch it replaces `HEAD` in the log's directory (write a temporary file, fsync, rename,
fsync the directory) with `{"seq", "hash", "file"}` of the last record. `verify` checks that
the log reaches HEAD's seq and that the record there has HEAD's hash, and fails naming both ends
otherwise. Records past HEAD are accepted and counted (`unanchored`): a writer that crashed
between a batch's fsync and HEAD's leaves them, never acknowledged; its restart anchors them.
A restarted writer whose log ends before HEAD (or differs at HEAD's seq) refuses to start
(AuditLogDamaged) rather than write on and re-anchor a shortened log; a log with records and no
HEAD (written before HEAD existed) is anchored where it ends, with a warning.

What HEAD does not prove: someone who may write the directory can rewrite HEAD together with the
chain's end. Against them, keep a copy of the head elsewhere (`pdserve audit verify` prints it;
HEAD is one line) and check the log against it: `verify(dir, anchor=(seq, hash))`,
`pdserve audit verify DIR --anchor SEQ:HASH`: records up to that one cannot be removed or changed
without `verify` failing.

Files are `audit-YYYYMMDD-SEQ.jsonl` (the UTC day of their first record, the seq it starts at);
a new file starts when the current one passes `max_file_bytes` or the day changes. Each batch is
written with one write() and made durable with one fsync() before `append` returns, and only then
does it count: the chain's head, the next seq and the dedup set move after the fsync. A write or
fsync that fails (a full disk) leaves the file as it was (truncated back to its size before the
batch, fsynced; if that fails too, the next `append` does it first) and raises: nothing of the
batch was acknowledged, and its resend is written in full. A line cut off by a crash mid-write was
never acknowledged either: `open` truncates it (its sender resends it).

Plain Python, no Ray: the writer actor (audit_actor.py) is a thin shell over `AuditLog`; the
`pdserve audit verify` command calls `verify`. The clock is injected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

log = logging.getLogger(__name__)

GENESIS = "0" * 64
PATTERN = "audit-*.jsonl"
HEAD = "HEAD"  # the anchor of the chain's end, in the log's directory


class AuditLogDamaged(RuntimeError):
    """The log on disk ends before its HEAD (or differs there): the writer does not start on it."""


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def record_hash(record: dict) -> str:
    """sha256 over the record's canonical JSON without its own `hash` field."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def log_files(directory: str | Path) -> list[Path]:
    """The log's files in chain order (by their starting seq)."""
    return sorted(Path(directory).glob(PATTERN), key=lambda p: int(p.stem.rsplit("-", 1)[1]))


def read_head(directory: str | Path) -> dict | None:
    """The directory's HEAD: {"seq", "hash", "file"} of the last record anchored; None if there is none."""
    try:
        raw = (Path(directory) / HEAD).read_bytes()
    except FileNotFoundError:
        return None
    head = json.loads(raw)
    if not (isinstance(head, dict) and isinstance(head.get("seq"), int) and isinstance(head.get("hash"), str)):
        raise ValueError(f"not a HEAD: {raw[:200]!r}")
    return head


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self._size = 0  # the current file's durable size: what a failed batch is cut back to
        self._dirty = False  # bytes past _size may be in the file (a failed batch whose cut-back failed too)
        self._anchored = True  # HEAD names the chain's head
        self.fsyncs = 0  # batches made durable by this instance (the benchmark's writer calls)
        self._recover()

    # ---- start-up: the chain's head and the dedup window, from the log's tail ------------------

    def _recover(self) -> None:
        files = log_files(self.dir)
        try:
            anchor = read_head(self.dir)
        except ValueError as e:
            raise AuditLogDamaged(f"{self.dir / HEAD}: {e} (pdserve audit verify {self.dir})") from e
        if not files:
            if anchor is not None:
                raise AuditLogDamaged(f"{self.dir}: no audit files, but its HEAD names record seq {anchor['seq']} in "
                                      f"{anchor.get('file')}: the log was removed (pdserve audit verify {self.dir})")
            return
        last = files[-1]
        data = last.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a batch cut off mid-line by a crash: never acknowledged, resent by its sender
            with open(last, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        tail: list[dict] = []
        for path in reversed(files):  # newest first, until the window is full and HEAD's record is read
            lines = path.read_bytes().splitlines()
            tail[:0] = [json.loads(line) for line in lines if line]
            if len(tail) >= self.dedup_window and (anchor is None or (tail and tail[0]["seq"] <= anchor["seq"])):
                break
        for rec in tail[-self.dedup_window:]:
            self._seen[rec["request_id"]] = None
        if tail:
            self.next_seq, self.head = tail[-1]["seq"] + 1, tail[-1]["hash"]
        self._open(last)
        self._check_anchor(anchor, tail, last)

    def _check_anchor(self, anchor: dict | None, tail: list[dict], last: Path) -> None:
        """The log must reach HEAD, with HEAD's hash there; past it are records whose batch was not
        acknowledged (the writer crashed before HEAD moved): they are anchored now."""
        if anchor is None:
            if tail:
                log.warning("audit log %s has no HEAD (written before HEAD existed, or HEAD removed): anchored at "
                            "its end, record seq %d", self.dir, self.next_seq - 1)
                self._anchored = False
                self._write_head()
            return
        at = next((r for r in tail if r["seq"] == anchor["seq"]), None)
        if at is None or at["hash"] != anchor["hash"]:
            ends = f"ends at record seq {self.next_seq - 1} ({last.name})" if tail else "has no records"
            what = ("records were removed from its end" if at is None else
                    "the record there is not the one HEAD names (its end was rewritten)")
            raise AuditLogDamaged(
                f"{self.dir}: the log {ends} but its HEAD names record seq {anchor['seq']} in {anchor.get('file')}: "
                f"{what}. The writer does not append to it: check it with `pdserve audit verify {self.dir}`, then "
                f"move it aside (or, to accept it as it is, remove its HEAD)")
        if anchor["seq"] < self.next_seq - 1:
            log.warning("audit log %s: records seq %d..%d were written after HEAD (a writer crash before HEAD "
                        "moved; their batch was never acknowledged): anchored now", self.dir, anchor["seq"] + 1,
                        self.next_seq - 1)
            self._anchored = False
            self._write_head()

    def close(self) -> None:
        """Let the log go (its writer opened another); nothing unacknowledged is pending here."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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
        fsync_dir(self.dir)  # the new name is durable too

    # ---- appending -----------------------------------------------------------------------------

    def seen(self, request_id: str) -> bool:
        return request_id in self._seen

    def append(self, records: Iterable[dict]) -> AppendResult:
        """Chain, write and fsync the records whose request id is new; one write and one fsync per
        batch (per file, when the batch crosses a rotation), then HEAD. Durable and anchored when
        this returns. Raises when a write or fsync fails: what was not durable is cut off the file
        and not counted (not in the chain, not in the dedup set), so the resend writes it."""
        self._cut_back()
        now = self.clock()
        self._rotate_if_due(now)
        written = duplicates = 0
        chunk: list[bytes] = []
        ids: list[str] = []
        batch_ids: set[str] = set()
        seq, head, size = self.next_seq, self.head, self._size
        for rec in records:
            rid = rec["request_id"]
            if rid in self._seen or rid in batch_ids:
                duplicates += 1
                continue
            rec = {k: v for k, v in rec.items() if k not in ("seq", "prev", "hash")}
            rec["seq"], rec["prev"] = seq, head
            rec["hash"] = record_hash(rec)
            line = canonical(rec) + b"\n"
            chunk.append(line)
            ids.append(rid)
            batch_ids.add(rid)
            seq, head, size = seq + 1, rec["hash"], size + len(line)
            if size >= self.max_file_bytes:  # the rest of the batch goes to the next file
                self._flush(chunk, ids, seq, head, size)
                written += len(ids)
                chunk, ids = [], []
                self._rotate_if_due(now)
                size = self._size
        if chunk:
            self._flush(chunk, ids, seq, head, size)
            written += len(ids)
        if not self._anchored:  # also after an all-duplicate resend of a batch whose HEAD write failed
            self._write_head()
        return AppendResult(written, duplicates)

    def _flush(self, chunk: list[bytes], ids: list[str], seq: int, head: str, size: int) -> None:
        """Write and fsync one file's part of a batch; only then take its records into the state."""
        try:
            view = memoryview(b"".join(chunk))
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except BaseException:
            self._dirty = True
            try:
                self._cut_back()
            except OSError as e:  # the next append tries again before it writes anything
                log.error("audit log %s: a failed batch could not be cut off yet (%r)", self._file, e)
            raise
        self.fsyncs += 1
        self.next_seq, self.head, self._size = seq, head, size
        for rid in ids:
            self._remember(rid)
        self._anchored = False

    def _cut_back(self) -> None:
        """Truncate the current file back to its durable size (a failed batch's bytes, partial or whole)."""
        if self._dirty:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
            self._dirty = False

    def _write_head(self) -> None:
        """Replace HEAD atomically and durably: a temporary file, fsync, rename, fsync the directory."""
        data = json.dumps({"seq": self.next_seq - 1, "hash": self.head, "file": self._file.name}, sort_keys=True)
        tmp = self.dir / (HEAD + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            view = memoryview(data.encode() + b"\n")
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / HEAD)
        fsync_dir(self.dir)
        self._anchored = True

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
    unanchored: int = 0  # records past HEAD (a writer crash before HEAD moved: never acknowledged)


def _lines(files: list[Path]) -> Iterator[tuple[Path, int, bytes]]:
    for path in files:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                yield path, n, line


def _anchors(p: Path, is_dir: bool, anchor: tuple[int, str] | None):
    """What the log's end is checked against: [(where, seq, hash, file)] (HEAD's, then the given
    anchor's), or the VerifyResult of a HEAD that is unreadable or missing."""
    anchors: list[tuple[str, int, str, str | None]] = []
    if is_dir:
        try:  # read before the files: a live writer moves HEAD only after its records are durable
            head_file = read_head(p)
        except ValueError as e:
            return VerifyResult(False, 0, 0, GENESIS, f"{p / HEAD}: {e}")
        if head_file is None:
            if log_files(p):
                return VerifyResult(False, 0, len(log_files(p)), GENESIS,
                                    f"{p / HEAD}: no HEAD file: nothing anchors the log's end, so records removed "
                                    f"from it could not be seen (a log written before HEAD existed gets one when "
                                    f"its writer starts)")
        else:
            anchors.append((f"{p / HEAD}", head_file["seq"], head_file["hash"], head_file.get("file")))
    if anchor is not None:
        anchors.append(("anchor", int(anchor[0]), anchor[1], None))
    return anchors


def verify(path: str | Path, anchor: tuple[int, str] | None = None) -> VerifyResult:
    """Check the chain of a log directory (every file, in order, and its end against HEAD) or of
    one file (its first record's `prev` taken on trust, no HEAD). `anchor`: (seq, hash) of a record
    kept elsewhere (an earlier head): the log must still hold it. Stops at the first failure."""
    p = Path(path)
    is_dir = p.is_dir()
    anchors = _anchors(p, is_dir, anchor)
    if isinstance(anchors, VerifyResult):
        return anchors
    files = log_files(p) if is_dir else [p]
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
        if head is None and is_dir and (rec["seq"] != 0 or rec["prev"] != GENESIS):
            error = f"{where}: {label}: the log does not start at seq 0 (earlier records removed)"
        elif head is not None and rec["seq"] != seq + 1:
            error = f"{where}: {label}: expected seq {seq + 1} (a record is missing or out of order)"
        elif rec.get("hash") != record_hash(rec):
            error = f"{where}: {label}: its hash does not match its content (edited)"
        elif head is not None and rec["prev"] != head:
            error = (f"{where}: {label}: prev does not match the hash of record seq {seq} "
                     f"(a record before it was edited or removed)")
        else:
            error = next((f"{where}: {label}: its hash is not the one its {'HEAD' if src != 'anchor' else 'anchor'} "
                          f"names ({h}): the log was rewritten from there"
                          for src, s, h, _ in anchors if s == rec["seq"] and h != rec["hash"]), None)
        if error is not None:
            return VerifyResult(False, count, len(files), head or GENESIS, error)
        count, head, seq = count + 1, rec["hash"], rec["seq"]
    names = {f.name for f in files}
    for src, s, h, file in anchors:
        if seq is None or s > seq:
            ends = f"ends at record seq {seq}" if seq is not None else "has no records"
            in_file = f" in {file}{'' if file in names else ' (missing)'}" if file else ""
            what = "its HEAD" if src != "anchor" else "the anchor"
            return VerifyResult(False, count, len(files), head or GENESIS,
                                f"{src}: the log {ends} but {what} names record seq {s} (hash {h}){in_file}: "
                                f"records were removed from its end")
    unanchored = seq - anchors[0][1] if is_dir and anchors and anchors[0][0] != "anchor" else 0
    return VerifyResult(True, count, len(files), head or GENESIS, unanchored=unanchored)


def read_records(path: str | Path) -> Iterator[dict]:
    p = Path(path)
    for _, _, raw in _lines(log_files(p) if p.is_dir() else [p]):
        yield json.loads(raw)
