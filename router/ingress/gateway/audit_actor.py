"""The audit writer actor: the one process that appends to the audit log (a thin Ray shell over
router/ingress/gateway/audit_log.py's AuditLog). Detached, named, restarted by Ray when it dies, and
pinned to the head node, where the log's directory is. One per Serve app (router/actor.py), holding
its directory's lock: a second app's writer on the same directory is refused, naming audit.dir. A
restarted writer runs with the settings it last ran with, and reads the chain's head
and the last `dedup_window` request ids back from the log's tail, so a batch resent because its
acknowledgement was lost is not written twice. A log whose end was removed (it ends before its
HEAD) makes the writer refuse every call (AuditLogDamaged, tried again at each): the ingresses keep
their records and, past audit.max_buffered, refuse requests, until someone looks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from cluster.config import AuditOptions
from cluster.config.front_door import state_path
from router.actor import ConfiguredRef, Exclusive, keep, restored, scoped_name, serve_app
from router.ingress.gateway.audit_log import AuditLog

log = logging.getLogger(__name__)

AUDIT_WRITER = "audit-writer"
HEAD_NODE = {"node:__internal_head__": 0.001}
LOCK = ".writer.lock"  # in the log's directory, held by its one writer


@dataclass(frozen=True)
class WriterSettings:
    """What the writer takes from the config: audit.dir, audit.max_file_bytes, audit.dedup_window."""

    dir: str | None
    max_file_bytes: int
    dedup_window: int

    @classmethod
    def of(cls, o: AuditOptions) -> "WriterSettings":
        return cls(o.dir, o.max_file_bytes, o.dedup_window)


@ray.remote(num_cpus=0, max_restarts=-1, resources=HEAD_NODE)
class AuditWriter:
    def __init__(self, settings: WriterSettings):
        self.settings = restored(settings)  # what it runs with once its log is open
        self.log, self._lock = None, None
        self._metrics = None
        try:
            from cluster.telemetry.metrics import audit_writer_metrics  # noqa: PLC0415

            self._metrics = audit_writer_metrics()
        except Exception:  # noqa: BLE001 — metrics are optional here (no Ray metrics agent)
            pass
        try:  # opened now; a refusal (another writer's directory, a damaged log) is raised by each call
            self._open(self.settings)
        except Exception as e:  # noqa: BLE001
            log.error("audit writer: %s", e)

    def configure(self, settings: WriterSettings) -> WriterSettings:
        """Run with these settings from now on: another directory is opened (its lock taken, its
        chain's head read back) before the old one is let go; a refusal (ValueError: the directory
        is another writer's; AuditLogDamaged) raises and leaves the writer as it was."""
        if settings != self.settings or self.log is None:
            self._open(settings)
            keep(settings)
        return self.settings

    def _open(self, s: WriterSettings) -> None:
        # None: the default state directory of the user this actor runs as, on this (the head) node
        path = state_path(s.dir, "audit")
        if self.log is not None and path == self.log.dir:
            self.log.max_file_bytes, self.log.dedup_window = s.max_file_bytes, s.dedup_window
        else:
            lock = Exclusive(path / LOCK, "audit.dir")
            try:
                opened = AuditLog(path, s.max_file_bytes, s.dedup_window)
            except BaseException:
                lock.release()
                raise
            if self.log is not None:
                self.log.close()
                self._lock.release()
            self.log, self._lock = opened, lock
        self.settings = s

    def _log(self) -> AuditLog:
        if self.log is None:
            self._open(self.settings)
        return self.log

    def append(self, records: list[dict]) -> tuple[int, int]:
        """Durable (fsync) and anchored (HEAD) when it returns: (written, duplicates skipped). A
        failed write raises with nothing of the batch counted: the ingress's resend writes it."""
        result = self._log().append(records)
        if self._metrics is not None:
            for result_name, n in (("written", result.written), ("duplicate", result.duplicates)):
                if n:
                    self._metrics.records.inc(n, {"result": result_name})
        return result.written, result.duplicates

    def head(self) -> tuple[int, str]:
        """(records written so far, the chain's head hash)."""
        return self._log().next_seq, self.log.head

    def fsyncs(self) -> int:
        """Batches this writer made durable since it started (one write + fsync each)."""
        return self._log().fsyncs


def get_audit_writer(options: AuditOptions, app: str | None = None) -> ConfiguredRef:
    """The app's audit writer (None: the caller's app), running with these options' settings."""
    return ConfiguredRef(AuditWriter, scoped_name(app or serve_app(), AUDIT_WRITER), WriterSettings.of(options))
