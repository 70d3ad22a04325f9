"""The ingress side of the audit log: one record per request that reached the flow, spooled
locally before the client sees the request end, and shipped to the writer actor off the request path.

    flow ──AuditTrail.delta/end──▶ Spool (this node's disk, no fsync) ──Shipper task──▶ writer actor
                                                                                      (chain + fsync per batch)

Delivery is at-least-once. A record is appended to this process's spool (one small write(), so it
survives the process being killed, not the node) before the final delta is yielded or the error
raised, and it stays in memory and in the spool until the writer acknowledges the batch that
carried it. A failed or timed-out call is retried with backoff. An ingress that dies leaves its
spool behind; any ingress on the node adopts it (its lock file is free once its owner is dead)
and resends what it holds; the writer drops records whose request id it already wrote. Spool
directories are created mode 0700, and only files this server's user could have written alone are
adopted (`Spool.adopt`): a symlink, another user's file or one writable by group or others is refused.

Writer down for long: records pile up (memory + spool) to `audit.max_buffered` per ingress; then
`when_full: refuse` refuses new requests with UNAVAILABLE (fail closed: nothing runs unaudited;
the records of requests already running are still kept, so the bound is max_buffered + max_inflight),
`when_full: drop` runs them and drops their records, counted in pdserve_audit_dropped_total.

A record holds ids, tenant, model and fingerprint, token counts, finish reason, the final status
code, guardrail interventions, timings and cost; the prompt and output text only for a tenant
with `audit_text: true`. Requests refused before their version's gateway (an unknown key, an
unknown model, a pin denied, a bad parameter) leave a `refused` record with the code and the
field (`refusal_record`; kept only while the buffer is under REFUSAL_BUFFER_SHARE, so a flood of
unauthenticated calls cannot fill it), and each shadow mirror one with its outcome (`shadow_record`).
Adopting dead spools runs in a worker thread; a record's own write (one write() of a short line,
no fsync) stays on the request's path: it is what puts the record on disk before the client sees
the request end.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from router.ingress.gateway.audit_log import canonical
from router.ingress.gateway.stages import Outcome, Stage
from router.ingress.status import Code, ServingError, error_code

if TYPE_CHECKING:
    from cluster.config import AppConfig, AuditOptions
    from router.ingress.request import ClientRequest, Delta

log = logging.getLogger(__name__)

SEGMENT_BYTES = 1 << 20  # a spool segment is deleted once every record in it is acknowledged
ADOPT_INTERVAL_S = 5.0
ADOPT_CHUNK = 256  # adopted records added under the spool's lock at a time
# A refusal before the gateway is recorded only while the buffer is under this share of
# max_buffered: a refusal costs its caller nothing (no key needed), so a flood of them must not fill
# the buffer that `when_full: refuse` guards and refuse every tenant's requests.
REFUSAL_BUFFER_SHARE = 0.5
MAX_BACKOFF_S = 2.0


class Spool:
    """This process's unacknowledged records: in memory (in order) and in segment files
    `<owner>.<n>.jsonl` under `directory`, owned through a flock on `<owner>.lock`."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's only: adopted records are trusted
        st = self.dir.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            log.warning("audit spool directory %s is not private to this user (owner uid %d, mode %o): other users "
                        "may plant or remove spool files there (their files are refused at adoption)", self.dir,
                        st.st_uid, st.st_mode & 0o777)
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock_fd = os.open(self.dir / f"{self.owner}.lock", os.O_RDWR | os.O_CREAT, 0o640)
        # add/batch/ack run on the event loop, adopt in a worker thread (it reads whole dead spools)
        self._mutex = threading.Lock()
        self._refused: set[str] = set()  # spool files already refused (logged once)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.pending: deque[tuple[int, dict]] = deque()  # (segment, record), oldest first
        self._unacked: dict[int, int] = {}
        self._segment = -1
        self._fd: int | None = None
        self._size = 0
        self._new_segment()

    def _path(self, segment: int, owner: str | None = None) -> Path:
        return self.dir / f"{owner or self.owner}.{segment}.jsonl"

    def _new_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._drop_if_done(self._segment)
        self._segment += 1
        self._unacked[self._segment] = 0
        self._fd = os.open(self._path(self._segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._size = 0

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, record: dict) -> None:
        with self._mutex:
            self._add(record)

    def _add(self, record: dict) -> None:
        line = canonical(record) + b"\n"
        os.write(self._fd, line)  # one write of a short line: whole in the page cache, or not at all
        self._size += len(line)
        self.pending.append((self._segment, record))
        self._unacked[self._segment] += 1
        if self._size >= SEGMENT_BYTES:
            self._new_segment()

    def batch(self, n: int) -> list[dict]:
        with self._mutex:
            return [rec for _, rec in list(self._peek(n))]

    def _peek(self, n: int):
        for i, item in enumerate(self.pending):
            if i >= n:
                return
            yield item

    def ack(self, n: int) -> None:
        with self._mutex:
            for _ in range(n):
                segment, _rec = self.pending.popleft()
                self._unacked[segment] -= 1
                self._drop_if_done(segment)

    def _drop_if_done(self, segment: int) -> None:
        if self._unacked.get(segment) != 0:
            return
        if segment == self._segment:
            if self._size:  # all acknowledged: empty the current segment (O_APPEND writes go to the new end)
                os.ftruncate(self._fd, 0)
                self._size = 0
            return
        del self._unacked[segment]
        self._path(segment).unlink(missing_ok=True)

    def adopt(self) -> int:
        """Take over the spools of dead owners on this node (their lock is free): their records
        join this spool (resent; the writer drops any it already has), then their files go.
        A file this server could not have written (a symlink, another user's, or writable by group
        or others: anyone could have put records in it) is refused: left where it is, logged once.
        Safe beside add/batch/ack: the shipper runs it in a worker thread (a dead spool can hold
        megabytes of records to read and parse; it ran on the ingress's event loop)."""
        adopted = 0
        for lock in self.dir.glob("*.lock"):
            owner = lock.stem
            if owner == self.owner:
                continue
            try:
                fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            except OSError as e:  # a symlink (ELOOP), or not ours to open
                self._refuse(lock, f"cannot be opened ({e.strerror})")
                continue
            try:
                if not self._trusted(lock, fd):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                segments = sorted(self.dir.glob(f"{owner}.*.jsonl"), key=lambda p: int(p.name.split(".")[-2]))
                taken = []
                for seg in segments:
                    data = self._read_trusted(seg)
                    if data is None:
                        continue
                    taken.append(seg)
                    adopted += self._add_lines(seg, data)
                for seg in taken:
                    seg.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
            finally:
                os.close(fd)
        if adopted:
            log.warning("audit: adopted %d unacknowledged records from dead ingress spools in %s", adopted, self.dir)
        return adopted

    def _add_lines(self, seg: Path, data: bytes) -> int:
        """A dead spool segment's records, parsed outside the lock and added in chunks under it."""
        records = []
        for line in data.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line its owner was killed in the middle of writing
                log.error("audit spool %s: an unreadable line was skipped", seg)
        for i in range(0, len(records), ADOPT_CHUNK):  # the loop's add waits at most one chunk
            with self._mutex:
                for rec in records[i:i + ADOPT_CHUNK]:
                    self._add(rec)
        return len(records)

    def _trusted(self, path: Path, fd: int) -> bool:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            self._refuse(path, "is not a regular file")
        elif st.st_uid != os.geteuid():
            self._refuse(path, f"is not owned by this user (uid {st.st_uid}, this server runs as {os.geteuid()})")
        elif st.st_mode & 0o022:
            self._refuse(path, f"is writable by group or others (mode {st.st_mode & 0o777:o})")
        else:
            return True
        return False

    def _read_trusted(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._refuse(path, f"cannot be opened ({e.strerror})")
            return None
        try:
            if not self._trusted(path, fd):
                return None
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _refuse(self, path: Path, why: str) -> None:
        if path.name not in self._refused:
            self._refused.add(path.name)
            log.error("audit spool file %s refused: it %s, so this server did not write it alone; its records are "
                      "not sent (left in place for someone to look at)", path, why)


class AuditShipper:
    """Owns the spool and the background task that sends batches to the writer actor.
    `writer()` returns the writer actor's handle (looked up again after a failure)."""

    def __init__(self, options: "AuditOptions", writer: Callable[[], object], metrics=None):
        self.options = options
        self._writer_fn = writer
        self._writer = None
        self.spool = Spool(options.spool_directory())  # resolved here, on this ingress's node
        self.metrics = metrics  # (dropped counter, unacked gauge) or None
        self.dropped = 0
        self._wake = asyncio.Event()  # a record was spooled: the idle shipper starts gathering
        self._send_now = asyncio.Event()  # a full batch, or a drain: the gathering ends early
        self._draining = False  # from drain() on, nothing waits to gather
        self._empty = asyncio.Event()  # set while nothing waits for the writer
        self._task: asyncio.Task | None = None
        self._adopt_at = 0.0

    @property
    def full(self) -> bool:
        return len(self.spool) >= self.options.max_buffered

    def refusal(self) -> ServingError | None:
        """With `when_full: refuse` and the buffer full: the error that refuses a request before
        any work (fail closed); None when it may run."""
        if self.options.when_full == "refuse" and self.full:
            return ServingError(Code.UNAVAILABLE, f"the audit log is unavailable ({len(self.spool)} records wait for "
                                                  f"its writer): requests are refused until it catches up", 1.0)
        return None

    def submit(self, record: dict) -> bool:
        """Spool a record. Full: `drop` drops it (counted); `refuse` keeps it (the requests already
        running when the buffer filled: at most admission.max_inflight more, new ones are refused)."""
        if self.full and self.options.when_full == "drop":
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.audit_dropped.inc(1)
            log.error("audit: buffer full (%d records): record of request %s dropped", len(self.spool),
                      record.get("request_id"))
            return False
        self.spool.add(record)
        self._empty.clear()
        self._ensure_task()
        self._wake.set()
        if len(self.spool) >= self.options.batch_records:
            self._send_now.set()
        return True

    def refused(self, record: dict) -> bool:
        """Spool the record of a request refused before its version's gateway (`refusal_record`),
        unless the buffer is at REFUSAL_BUFFER_SHARE: then it is dropped (counted as dropped)."""
        if len(self.spool) >= REFUSAL_BUFFER_SHARE * self.options.max_buffered:
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.audit_dropped.inc(1)
            return False
        return self.submit(record)

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def start(self) -> None:
        """Start shipping (adopting dead spools first): called once the event loop runs."""
        self._ensure_task()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            now = time.monotonic()
            if now >= self._adopt_at:
                self._adopt_at = now + ADOPT_INTERVAL_S
                await asyncio.to_thread(self.spool.adopt)  # off the event loop: it reads whole files
            if not self.spool.pending:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), ADOPT_INTERVAL_S)
                except (TimeoutError, asyncio.TimeoutError):
                    continue
            if len(self.spool) < self.options.batch_records and not self._draining:
                await self._gather()
            batch = self.spool.batch(self.options.batch_records)
            try:
                if self._writer is None:
                    self._writer = self._writer_fn()
                await asyncio.wait_for(self._writer.append.remote(batch), self.options.writer_timeout_s)
            except Exception as e:  # noqa: BLE001 — kept, and sent again
                log.warning("audit: the writer did not take %d records (%r); retrying in %.2f s", len(batch), e,
                            backoff)
                self._writer = None
                self._export()
                await asyncio.sleep(backoff)  # backoff between retries of a failed call
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = 0.05
            self.spool.ack(len(batch))
            if not self.spool.pending:
                self._empty.set()
            self._export()

    async def _gather(self) -> None:
        """Wait flush_interval_s for more records (one writer call and one fsync per batch, so a
        call's fixed cost is paid once a second, not once a record), or until a batch fills or
        a drain begins."""
        self._send_now.clear()
        try:
            await asyncio.wait_for(self._send_now.wait(), self.options.flush_interval_s)
        except (TimeoutError, asyncio.TimeoutError):
            pass

    async def drain(self, timeout_s: float) -> bool:
        """Until every spooled record is acknowledged, or timeout_s (a replica shutting down).
        What is left stays in the spool, for the next ingress on this node to adopt."""
        if self.spool.pending:
            self._draining = True
            self._ensure_task()
            self._wake.set()
            self._send_now.set()
            try:
                await asyncio.wait_for(self._empty.wait(), timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                log.warning("audit: %d records not acknowledged at shutdown: left in %s for adoption",
                            len(self.spool), self.spool.dir)
        return not self.spool.pending

    def _export(self) -> None:
        if self.metrics is not None:
            self.metrics.audit_unacked.set(len(self.spool))


def refusal_record(tenant: str, model: str | None, label: str | None, error: BaseException) -> dict:
    """The record of a request refused before its version's gateway: an unknown key (tenant
    "unknown"), an unknown model, a pin the tenant may not make, a bad parameter. The code and the
    field (never the message: it may quote the input)."""
    rec = _record(uuid.uuid4().hex, label, tenant, model or "", None)
    rec.update(code=error_code(error), duration_s=0.0, refused=True)
    field = getattr(error, "field", None)
    if isinstance(field, str):  # a bad parameter: the top-level field, as the metrics' reason
        rec["field"] = field.split(".", 1)[0]
    return rec


def shadow_record(rid: str, tenant: str, label: str | None, model: str, version: str, fingerprint: str,
                  outcome: str) -> dict:
    """The record of a shadow mirror (versions/shadow.py): the tenant's prompt ran on a candidate
    version, compared and dropped; its outcome (same, different, failed, shed), never any text."""
    rec = _record(rid, label, tenant, model, fingerprint)
    code = {"same": "OK", "different": "OK", "shed": "RESOURCE_EXHAUSTED"}.get(outcome, "UNAVAILABLE")
    rec.update(code=code, shadow=True, model_version=version, shadow_outcome=outcome)
    return rec


def _record(rid: str, label: str | None, tenant: str, model: str, fingerprint: str | None) -> dict:
    return {"request_id": rid, "client_request_id": label, "tenant": tenant, "model": model,
            "model_fingerprint": fingerprint, "received_at": round(time.time(), 6), "prompt_tokens": 0,
            "completion_tokens": 0, "cached_prompt_tokens": 0, "finish_reason": None, "code": None,
            "interventions": [], "ttft_s": None, "duration_s": None, "cost_usd": 0.0}


class AuditTrail:
    """One request's audit record, built as the flow runs and submitted once: on the final delta
    (before it is yielded) or at the end (before the error reaches the client)."""

    def __init__(self, shipper: AuditShipper, rid: str, client_request_id: str | None, tenant: str, model: str,
                 fingerprint: str, keep_text: bool, prompt_input=None):
        self.shipper = shipper
        self.started = time.monotonic()
        self.rec: dict = _record(rid, client_request_id, tenant, model, fingerprint)
        self.keep_text = keep_text
        if keep_text:
            self.rec["prompt"] = prompt_input
            self.rec["output"] = ""
        self.submitted = False

    def delta(self, d: "Delta", cost_usd: float | None = None, interventions=(), cache_hit: bool = False) -> None:
        rec = self.rec
        if rec["ttft_s"] is None and d.token_ids:
            rec["ttft_s"] = round(time.monotonic() - self.started, 6)
        if self.keep_text:
            rec["output"] += d.text
        rec["prompt_tokens"], rec["completion_tokens"] = d.prompt_tokens, d.completion_tokens
        rec["cached_prompt_tokens"] = d.cached_prompt_tokens
        if d.finish_reason is not None:
            rec["finish_reason"] = str(d.finish_reason)
            if cache_hit:
                rec["response_cache_hit"] = True
            self._submit("OK", cost_usd, interventions)

    def end(self, error: BaseException | None, cost_usd: float | None = None, interventions=()) -> None:
        if not self.submitted:
            # the code only: an error's message may quote the client's input
            self._submit("INTERNAL" if error is None else error_code(error), cost_usd, interventions)

    def _submit(self, code: str, cost_usd: float | None, interventions) -> None:
        self.submitted = True
        rec = self.rec
        rec["code"] = code
        rec["duration_s"] = round(time.monotonic() - self.started, 6)
        if cost_usd is not None:
            rec["cost_usd"] = cost_usd
        if interventions:  # the guardrails' events (router/ingress/gateway/guardrails.py): never any text
            rec["interventions"] = [asdict(i) if is_dataclass(i) else str(i) for i in interventions]
        self.shipper.submit(rec)


class AuditStage(Stage):
    """One record per request (its tenant's `audit` allowing), spooled before the final delta
    reaches the client, or at the end with the error's code. With the buffer full and `when_full:
    refuse`, nothing runs unaudited."""

    def __init__(self, shipper: AuditShipper, config: "AppConfig", fingerprint: str):
        self.shipper = shipper
        self.config = config  # the version's: its model name and the tenants' audit options
        self.fingerprint = fingerprint

    async def admit(self, o: Outcome) -> None:
        opts = self.config.tenants.get(o.tenant)
        if opts is not None and not opts.audit:
            return
        refusal = self.shipper.refusal()
        if refusal is not None:  # its record could not be kept either; the refusal is counted in the metrics
            raise refusal
        keep_text = opts is not None and opts.audit_text
        o.trail = AuditTrail(self.shipper, o.rid, o.request.label, o.tenant, self.config.model_name, self.fingerprint,
                             keep_text, _prompt_input(o.request) if keep_text else None)

    def delta(self, o: Outcome, d: "Delta") -> None:
        if o.trail is not None:  # the final delta's record is spooled before the client gets it
            cost = None
            if d.finish_reason is not None:
                cost = o.price(d.prompt_tokens, d.completion_tokens) if o.price and d.completion_tokens else 0.0
            o.trail.delta(d, cost, o.interventions, o.cache_hit)

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.trail is not None:
            o.trail.end(error, o.cost_usd, o.interventions)


def _prompt_input(r: "ClientRequest"):
    """What a text-keeping tenant's record holds of the prompt: messages, text or token ids."""
    return list(r.messages) if r.messages is not None else r.prompt if r.prompt is not None else list(
        r.prompt_token_ids or ())
