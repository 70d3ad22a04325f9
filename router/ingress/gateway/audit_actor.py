"""The audit writer actor: the one process that appends to the audit log (a thin Ray shell over
router/ingress/gateway/audit_log.py's AuditLog). Detached, named, restarted by Ray when it dies, and
pinned to the head node, where the log's directory is. A restarted writer reads the chain's head
and the last `dedup_window` request ids back from the log's tail, so a batch resent because its
acknowledgement was lost is not written twice. A log whose end was removed (it ends before its
HEAD) makes the writer refuse to start (AuditLogDamaged): the ingresses keep their records and,
past audit.max_buffered, refuse requests, until someone looks."""

from __future__ import annotations

import ray

from cluster.config import AuditOptions
from cluster.config.front_door import state_path
from router.actor import named_actor
from router.ingress.gateway.audit_log import AuditLog

AUDIT_WRITER_NAME = "pdserve-audit-writer"
HEAD_NODE = {"node:__internal_head__": 0.001}


@ray.remote(num_cpus=0, max_restarts=-1, resources=HEAD_NODE)
class AuditWriter:
    def __init__(self, directory: str | None, max_file_bytes: int, dedup_window: int):
        # None: the default state directory of the user this actor runs as, on this (the head) node
        self.log = AuditLog(state_path(directory, "audit"), max_file_bytes, dedup_window)
        self._metrics = None
        try:
            from cluster.telemetry.metrics import audit_writer_metrics  # noqa: PLC0415

            self._metrics = audit_writer_metrics()
        except Exception:  # noqa: BLE001 — metrics are optional here (no Ray metrics agent)
            pass

    def append(self, records: list[dict]) -> tuple[int, int]:
        """Durable (fsync) and anchored (HEAD) when it returns: (written, duplicates skipped). A
        failed write raises with nothing of the batch counted: the ingress's resend writes it."""
        result = self.log.append(records)
        if self._metrics is not None:
            for result_name, n in (("written", result.written), ("duplicate", result.duplicates)):
                if n:
                    self._metrics.records.inc(n, {"result": result_name})
        return result.written, result.duplicates

    def head(self) -> tuple[int, str]:
        """(records written so far, the chain's head hash)."""
        return self.log.next_seq, self.log.head

    def fsyncs(self) -> int:
        """Batches this writer made durable since it started (one write + fsync each)."""
        return self.log.fsyncs


def get_audit_writer(options: AuditOptions):
    """The cluster's audit writer, created by whoever asks first (with that caller's options)."""
    return named_actor(AuditWriter, AUDIT_WRITER_NAME, options.dir, options.max_file_bytes, options.dedup_window)
