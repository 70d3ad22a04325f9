"""The audit log's file format without Ray: the hash chain across rotated files, `verify` naming
the first bad record, deduplication by request id that survives a restart, and the ingress spool
(acknowledgement, adoption of a dead owner's records)."""

import errno
import json
import os

import pytest

from cluster.app.cli import main
from router.ingress.gateway.audit import Spool
from router.ingress.gateway import audit_log
from router.ingress.gateway.audit_log import GENESIS, AuditLog, canonical, log_files, read_records, record_hash, verify

DAY = 86400.0
T0 = 1_795_000_000.0  # 2026-11-18 UTC


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


def rec(i: int) -> dict:
    return {"request_id": f"r{i:04d}", "tenant": "t", "completion_tokens": i, "code": "OK"}


def write(tmp_path, n=100, max_file_bytes=4096, clock=None, batch=7):
    log = AuditLog(tmp_path, max_file_bytes=max_file_bytes, clock=clock or Clock())
    for start in range(0, n, batch):
        log.append([rec(i) for i in range(start, min(n, start + batch))])
    return log


def edit(path, line_no, change):
    lines = path.read_bytes().splitlines(keepends=True)
    r = json.loads(lines[line_no - 1])
    change(r)
    lines[line_no - 1] = canonical(r) + b"\n"
    path.write_bytes(b"".join(lines))
    return r


def test_the_chain_runs_through_rotated_files_and_verifies(tmp_path):
    log = write(tmp_path)
    files = log_files(tmp_path)
    records = list(read_records(tmp_path))
    assert [r["seq"] for r in records] == list(range(100))
    assert [r["request_id"] for r in records] == [f"r{i:04d}" for i in range(100)]
    assert records[0]["prev"] == GENESIS
    assert all(b["prev"] == a["hash"] == record_hash(a) for a, b in zip(records, records[1:]))
    longest = max(len(canonical(r)) + 1 for r in records)
    assert len(files) == 6 and all(f.stat().st_size < 4096 + longest for f in files)  # past the size: next file
    # each file is named by the seq it starts at, and its first record chains to the file before
    starts = [int(f.stem.rsplit("-", 1)[1]) for f in files]
    assert [json.loads(f.read_bytes().splitlines()[0])["seq"] for f in files] == starts
    result = verify(tmp_path)
    assert (result.ok, result.records, result.files, result.head) == (True, 100, len(files), log.head)
    assert main(["audit", "verify", str(tmp_path)]) == 0


def test_a_new_utc_day_starts_a_new_file_and_the_chain_continues(tmp_path):
    clock = Clock()
    log = AuditLog(tmp_path, clock=clock)
    log.append([rec(0), rec(1)])
    clock.t += DAY
    log.append([rec(2)])
    assert [f.name for f in log_files(tmp_path)] == ["audit-20261118-000000000000.jsonl",
                                                     "audit-20261119-000000000002.jsonl"]
    assert verify(tmp_path).ok and verify(tmp_path).records == 3


def test_an_edited_record_is_named(tmp_path, capsys):
    write(tmp_path)
    second = log_files(tmp_path)[1]
    edited = edit(second, 3, lambda r: r.update(completion_tokens=999))
    result = verify(tmp_path)
    assert not result.ok and result.records == edited["seq"]
    assert result.error == (f"{second}:3: record seq {edited['seq']} (request_id {edited['request_id']}): "
                            f"its hash does not match its content (edited)")
    assert main(["audit", "verify", str(tmp_path)]) == 1
    assert f"record seq {edited['seq']} (request_id {edited['request_id']})" in capsys.readouterr().err


def test_an_edit_that_recomputes_its_own_hash_breaks_the_next_record(tmp_path):
    write(tmp_path, n=20, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)

    def forge(r):
        r["completion_tokens"] = 0
        r["hash"] = record_hash(r)

    edit(path, 5, forge)
    result = verify(tmp_path)
    assert result.error == (f"{path}:6: record seq 5 (request_id r0005): prev does not match the hash of record "
                            f"seq 4 (a record before it was edited or removed)")


def test_a_removed_record_is_named_by_the_one_after_it(tmp_path):
    write(tmp_path, n=20, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:7] + lines[8:]))
    assert verify(tmp_path).error == (f"{path}:8: record seq 8 (request_id r0008): expected seq 7 "
                                      f"(a record is missing or out of order)")
    first = log_files(tmp_path)[0]
    first.write_bytes(b"".join(lines[1:]))  # the head of the log cut away
    assert "does not start at seq 0" in verify(tmp_path).error


def test_duplicates_are_skipped_and_dedup_survives_a_restart_from_the_log_tail(tmp_path):
    log = write(tmp_path, n=30)
    assert log.append([rec(29), rec(5), rec(30)]) == (1, 2)  # a resent batch: only r0030 is new
    head = (log.next_seq, log.head)
    log.close()
    again = AuditLog(tmp_path, max_file_bytes=4096, clock=Clock())
    assert (again.next_seq, again.head) == head
    assert again.append([rec(0), rec(30), rec(31)]) == (1, 2)
    assert again.append([rec(31)]) == (0, 1)
    assert again.fsyncs == 1  # one durable batch: an all-duplicate batch writes nothing
    ids = [r["request_id"] for r in read_records(tmp_path)]
    assert len(ids) == len(set(ids)) == 32 and verify(tmp_path).ok


def test_the_dedup_window_is_bounded(tmp_path):
    write(tmp_path, n=30).close()
    log = AuditLog(tmp_path, max_file_bytes=4096, dedup_window=5, clock=Clock())
    assert [log.seen(f"r{i:04d}") for i in (24, 25, 29)] == [False, True, True]
    assert len(log._seen) == 5


def test_a_batch_cut_off_by_a_crash_is_truncated_at_restart(tmp_path):
    write(tmp_path, n=10, max_file_bytes=1 << 20).close()
    [path] = log_files(tmp_path)
    with open(path, "ab") as f:
        f.write(b'{"request_id": "r0010", "seq": 10, "pre')
    assert verify(tmp_path).error == f"{path}:11: the last line is cut off"
    log = AuditLog(tmp_path, clock=Clock())
    assert log.append([rec(10)]) == (1, 0)  # the resend
    assert verify(tmp_path).ok and verify(tmp_path).records == 11


def test_the_spool_keeps_records_until_acknowledged_and_deletes_finished_segments(tmp_path, monkeypatch):
    monkeypatch.setattr("router.ingress.gateway.audit.SEGMENT_BYTES", 200)
    spool = Spool(tmp_path)
    for i in range(10):
        spool.add(rec(i))
    segments = sorted(tmp_path.glob(f"{spool.owner}.*.jsonl"))
    assert len(segments) >= 3
    assert spool.batch(4) == [rec(i) for i in range(4)] and len(spool) == 10
    spool.ack(10)
    assert len(spool) == 0
    left = list(tmp_path.glob(f"{spool.owner}.*.jsonl"))
    assert len(left) == 1 and left[0].stat().st_size == 0  # only the current one, emptied


def test_a_dead_owners_spool_is_adopted_and_a_live_one_is_not(tmp_path):
    dead, alive, me = Spool(tmp_path), Spool(tmp_path), None
    for i in range(3):
        dead.add(rec(i))
    alive.add(rec(50))
    dead.ack(1)  # acknowledged records are still in a segment file until it is finished: resent, deduplicated
    os.close(dead._lock_fd)  # its process died: the flock is released
    me = Spool(tmp_path)
    assert me.adopt() == 3
    assert me.batch(10) == [rec(0), rec(1), rec(2)]
    assert not list(tmp_path.glob(f"{dead.owner}.*")) and list(tmp_path.glob(f"{alive.owner}.*"))
    assert me.adopt() == 0


def test_a_full_buffer_refuses_requests_or_drops_their_records_as_configured(tmp_path):
    import asyncio

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import AuditShipper
    from router.ingress.status import Code

    def down():
        raise ConnectionError("the writer is down")

    async def scenario(when_full):
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path / when_full), max_buffered=2,
                                            when_full=when_full), down)
        results = [shipper.submit(rec(i)) for i in range(3)]
        refusal = shipper.refusal()
        shipper._task.cancel()
        return results, shipper.dropped, refusal, len(shipper.spool)

    results, dropped, refusal, held = asyncio.run(scenario("refuse"))
    assert (results, dropped, held) == ([True, True, True], 0, 3)  # a request already running keeps its record
    assert refusal.code is Code.UNAVAILABLE and "audit log is unavailable (3 records" in refusal.message
    results, dropped, refusal, held = asyncio.run(scenario("drop"))
    assert (results, dropped, refusal, held) == ([True, True, False], 1, None, 2)


def test_a_trail_records_counts_code_and_interventions_and_text_only_when_the_tenant_asks(tmp_path):
    import asyncio
    from dataclasses import dataclass, replace

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import AuditShipper, AuditTrail
    from router.ingress.request import Delta
    from router.ingress.status import Code, ServingError

    @dataclass(frozen=True)
    class Intervention:  # the guardrails' record (router/ingress/gateway/guardrails.py) as the Outcome keeps it
        policy: str
        action: str

    async def scenario():
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path)), lambda: None)
        shipper._ensure_task = lambda: None  # the spool only: no writer here
        plain = AuditTrail(shipper, "r1", "mine", "t", "m", "fp", keep_text=False)
        first = Delta("mine", "secret", [5], None, 3, 1)
        plain.delta(first)
        plain.delta(replace(first, text=" text", token_ids=[6], finish_reason="content_filter", completion_tokens=2),
                    cost_usd=0.25, interventions=[Intervention("p", "stopped")])
        plain.end(None)  # already submitted at the final delta: nothing more
        kept = AuditTrail(shipper, "r2", None, "t", "m", "fp", keep_text=True, prompt_input="hello")
        kept.delta(Delta("r2", "out", [7], None, 1, 1))
        kept.end(ServingError(Code.ABORTED, "lost the replica after 1 tokens"))
        return [rec for _, rec in shipper.spool.pending]

    one, two = asyncio.run(scenario())
    assert {k: one[k] for k in ("request_id", "client_request_id", "prompt_tokens", "completion_tokens",
                                "finish_reason", "code", "interventions", "cost_usd")} == {
        "request_id": "r1", "client_request_id": "mine", "prompt_tokens": 3, "completion_tokens": 2,
        "finish_reason": "content_filter", "code": "OK", "interventions": [{"policy": "p", "action": "stopped"}],
        "cost_usd": 0.25}
    assert "secret" not in json.dumps(one) and "prompt" not in one and "output" not in one
    assert (two["code"], two["finish_reason"], two["prompt"], two["output"]) == ("ABORTED", None, "hello", "out")
    assert "lost the replica" not in json.dumps(two)  # error messages may quote input: never recorded


def test_drain_waits_for_the_writers_acknowledgement_and_is_bounded(tmp_path):
    import asyncio

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import AuditShipper

    log = AuditLog(tmp_path / "log")

    class Writer:  # the writer actor's `append`, in process: the shipper awaits what `.remote` returns
        class append:  # noqa: N801
            @staticmethod
            async def remote(batch):
                return log.append(batch)

    def down():
        raise ConnectionError("the writer is down")

    async def scenario(writer):
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path / "spools"), flush_interval_s=0.01),
                               writer)
        for i in range(5):
            shipper.submit(rec(i))
        drained = await shipper.drain(0.5)
        shipper._task.cancel()
        return drained, len(shipper.spool)

    assert asyncio.run(scenario(lambda: Writer)) == (True, 0)
    assert [r["request_id"] for r in read_records(tmp_path / "log")] == [f"r{i:04d}" for i in range(5)]
    assert asyncio.run(scenario(down)) == (False, 5)  # left in the spool for adoption


def test_records_reach_the_writer_one_flush_interval_after_they_are_spooled(tmp_path):
    import asyncio
    import time

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import ADOPT_INTERVAL_S, AuditShipper

    log = AuditLog(tmp_path / "log")

    class Writer:  # the writer actor's `append`, in process
        class append:  # noqa: N801
            @staticmethod
            async def remote(batch):
                return log.append(batch)

    async def arrival(shipper, n: int) -> float:
        t0 = time.monotonic()
        while log.next_seq < n and time.monotonic() - t0 < 2 * ADOPT_INTERVAL_S:
            await asyncio.sleep(0.005)
        return time.monotonic() - t0

    async def scenario():
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path / "spools"), flush_interval_s=0.05,
                                            batch_records=512), lambda: Writer)
        shipper.start()
        await asyncio.sleep(0.01)  # the shipper now idles: nothing is spooled
        for i in range(3):  # far fewer than a batch
            shipper.submit(rec(i))
        first = await arrival(shipper, 3)
        shipper.submit(rec(3))
        second = await arrival(shipper, 4)
        shipper._task.cancel()
        return first, second

    first, second = asyncio.run(scenario())
    # sent after one flush interval, not when the shipper's idle wait (ADOPT_INTERVAL_S) ran out
    assert first < 1.0 and second < 1.0, (first, second)
    assert log.fsyncs == 2  # the three records gathered into one call, the fourth in the next
    assert [r["request_id"] for r in read_records(tmp_path / "log")] == [f"r{i:04d}" for i in range(4)]


def test_a_full_batch_or_a_drain_ends_the_gathering_early(tmp_path):
    import asyncio
    import time

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import AuditShipper

    log = AuditLog(tmp_path / "log")
    calls: list[int] = []

    class Writer:  # the writer actor's `append`, in process
        class append:  # noqa: N801
            @staticmethod
            async def remote(batch):
                calls.append(len(batch))
                return log.append(batch)

    async def scenario():
        # a flush interval far longer than the test: only a full batch or the drain can send
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path / "spools"), flush_interval_s=60.0,
                                            batch_records=4), lambda: Writer)
        shipper.start()
        await asyncio.sleep(0.01)
        for i in range(3):
            shipper.submit(rec(i))
        await asyncio.sleep(0.05)  # the shipper is gathering now
        t0 = time.monotonic()
        for i in range(3, 5):  # the fourth fills a batch
            shipper.submit(rec(i))
        while log.next_seq < 4 and time.monotonic() - t0 < 5.0:
            await asyncio.sleep(0.005)
        full_batch = time.monotonic() - t0
        drained = await shipper.drain(5.0)  # the fifth, gathering for its 60 s: the drain sends it now
        took = time.monotonic() - t0
        shipper._task.cancel()
        return full_batch, drained, took

    full_batch, drained, took = asyncio.run(scenario())
    assert full_batch < 1.0 and drained and took < 2.0, (full_batch, drained, took)
    assert calls == [4, 1] and log.next_seq == 5

    async def drain_before_the_shipper_ran():  # the drain's signal must not be lost to a later gather
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path / "spools2"), flush_interval_s=60.0,
                                            batch_records=4), lambda: Writer)
        shipper.submit(rec(5))  # the shipper task exists but has not run yet
        t0 = time.monotonic()
        drained = await shipper.drain(5.0)
        shipper._task.cancel()
        return drained, time.monotonic() - t0

    drained, took = asyncio.run(drain_before_the_shipper_ran())
    assert drained and took < 2.0, (drained, took)
    assert calls == [4, 1, 1] and log.next_seq == 6


def test_a_tenant_with_audit_off_gets_no_record_and_no_audit_refusal(tmp_path, tiny_model):
    import asyncio

    from cluster.config import AppConfig, AuditOptions
    from router.ingress.gateway.audit import AuditShipper
    from router.ingress.status import Code
    from tests.helpers import front_door, generate

    cfg = AppConfig(model=tiny_model, audit={"enabled": True, "dir": str(tmp_path)},
                    tenants={"quiet": {"api_keys": ["sk-q"], "audit": False}, "loud": {"api_keys": ["sk-l"]}})

    async def first_error(door, tenant):
        try:
            async for _ in generate(door, "hi", tenant=tenant, max_tokens=1):
                pass
        except Exception as e:  # noqa: BLE001 — what stopped it is the point
            return e

    async def scenario():
        shipper = AuditShipper(AuditOptions(enabled=True, dir=str(tmp_path), max_buffered=2, when_full="refuse"),
                               lambda: None)
        shipper._ensure_task = lambda: None  # the spool only: no writer here
        door = front_door(cfg, audit=shipper)
        errors = {t: await first_error(door, t) for t in ("quiet", "loud", "default")}
        held_before = len(shipper.spool)  # the buffer is now full: audited requests are refused
        errors |= {f"{t} full": await first_error(door, t) for t in ("quiet", "loud")}
        return held_before, errors, len(shipper.spool)

    held_before, errors, held = asyncio.run(scenario())
    # with room in the buffer: the audited tenants' failed requests each left a record, the quiet one none
    assert held_before == 2
    assert all(str(errors[t]).startswith("no decode replica") for t in ("quiet", "loud", "default"))
    # the unaudited tenant went past the full buffer to the engines (none here); the audited one was refused
    assert str(errors["quiet full"]).startswith("no decode replica")
    assert (errors["loud full"].code, str(errors["loud full"])) == (
        Code.UNAVAILABLE, "the audit log is unavailable (2 records wait for its writer): requests are refused until it "
                          "catches up")
    assert held == 2  # neither request added a record


# ---- a failed write or fsync loses nothing (issue 39) -------------------------------------------------

class DiskFull:
    """A fault from outside the class: `os.<name>` fails with ENOSPC on its calls number `fail_on`
    (1-based, counted from when it is installed); `partial` makes a failing write first write
    that many bytes, as a write cut short by a full disk does."""

    def __init__(self, monkeypatch, name: str, fail_on=(1,), partial: int = 0):
        self.real, self.calls, self.fail_on, self.partial = getattr(os, name), 0, set(fail_on), partial
        monkeypatch.setattr(os, name, self)

    def __call__(self, *args):
        self.calls += 1
        if self.calls in self.fail_on:
            if self.partial:
                fd, data = args
                self.real(fd, bytes(data[:self.partial]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(*args)


def ids_in(directory) -> list[str]:
    return [r["request_id"] for r in read_records(directory)]


@pytest.mark.parametrize("fault", ["write", "partial write", "fsync"])
def test_a_failed_write_or_fsync_leaves_the_log_as_it_was_and_the_resend_is_written_in_full(tmp_path, monkeypatch,
                                                                                           fault):
    log = write(tmp_path, n=10, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)
    before = (path.read_bytes(), log.next_seq, log.head)
    batch = [rec(i) for i in range(10, 15)]
    name = "fsync" if fault == "fsync" else "write"
    disk = DiskFull(monkeypatch, name, partial=40 if fault == "partial write" else 0)
    with pytest.raises(OSError) as e:
        log.append(batch)
    assert e.value.errno == errno.ENOSPC and disk.calls >= 1
    assert (path.read_bytes(), log.next_seq, log.head) == before  # nothing written, nothing committed
    assert [log.seen(r["request_id"]) for r in batch] == [False] * 5
    assert verify(tmp_path).ok and verify(tmp_path).records == 10
    assert log.append(batch) == (5, 0)  # the sender's resend: written in full, not taken for duplicates
    assert ids_in(tmp_path) == [f"r{i:04d}" for i in range(15)]
    assert verify(tmp_path).ok and verify(tmp_path).records == 15
    log.close()
    again = AuditLog(tmp_path, clock=Clock())  # and the restarted writer agrees
    assert (again.next_seq, again.head) == (15, log.head)


def test_a_disk_that_stays_full_is_cut_back_before_the_next_batch(tmp_path, monkeypatch):
    log = write(tmp_path, n=10, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)
    size = path.stat().st_size
    # the batch's fsync fails, then the fsync of the truncation back, then the next try's
    DiskFull(monkeypatch, "fsync", fail_on=(1, 2, 3))
    for _ in range(2):
        with pytest.raises(OSError):
            log.append([rec(10), rec(11)])
    assert path.stat().st_size == size
    assert log.append([rec(10), rec(11), rec(12)]) == (3, 0)
    assert ids_in(tmp_path) == [f"r{i:04d}" for i in range(13)] and verify(tmp_path).ok


def test_a_batch_that_fails_after_a_rotation_keeps_the_part_already_durable(tmp_path, monkeypatch):
    log = write(tmp_path, n=10, max_file_bytes=1024)
    batch = [rec(i) for i in range(10, 30)]  # crosses into a new file: the write to it fails
    disk = DiskFull(monkeypatch, "write", fail_on=(2,))
    with pytest.raises(OSError):
        log.append(batch)
    assert disk.calls == 2
    written = log.next_seq - 10
    assert 0 < written < 20 and verify(tmp_path).ok
    assert log.append(batch) == (20 - written, written)  # the durable part is acknowledged as duplicates
    assert ids_in(tmp_path) == [f"r{i:04d}" for i in range(30)]
    assert verify(tmp_path).ok and verify(tmp_path).records == 30


def test_a_duplicate_inside_one_batch_is_written_once(tmp_path):
    log = AuditLog(tmp_path, clock=Clock())
    assert log.append([rec(0), rec(1), rec(0)]) == (2, 1)
    assert ids_in(tmp_path) == ["r0000", "r0001"] and verify(tmp_path).ok


# ---- the chain's end is anchored (issue 39) -----------------------------------------------------------

def test_an_intact_log_passes_and_its_head_file_names_the_last_record(tmp_path, capsys):
    log = write(tmp_path)
    head = json.loads((tmp_path / "HEAD").read_bytes())
    assert (head["seq"], head["hash"], head["file"]) == (99, log.head, log_files(tmp_path)[-1].name)
    result = verify(tmp_path)
    assert (result.ok, result.records, result.head, result.unanchored) == (True, 100, log.head, 0)
    assert main(["audit", "verify", str(tmp_path)]) == 0
    assert f"chain head {log.head}" in capsys.readouterr().out


def test_removing_the_last_records_fails_verify(tmp_path, capsys):
    log = write(tmp_path, n=20, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))  # the last record cut away: the chain itself is still whole
    result = verify(tmp_path)
    assert not result.ok and result.records == 19
    assert result.error == (f"{tmp_path / 'HEAD'}: the log ends at record seq 18 but its HEAD names record seq 19 "
                            f"(hash {log.head}) in {path.name}: records were removed from its end")
    assert main(["audit", "verify", str(tmp_path)]) == 1
    assert "records were removed from its end" in capsys.readouterr().err


def test_deleting_the_last_file_fails_verify(tmp_path):
    write(tmp_path)
    files = log_files(tmp_path)
    files[-1].unlink()
    result = verify(tmp_path)
    assert not result.ok
    assert f"in {files[-1].name} (missing): records were removed from its end" in result.error


def test_a_rewritten_end_fails_verify(tmp_path):
    """Records removed and others chained in their place: the record at HEAD's seq is not HEAD's."""
    write(tmp_path, n=20, max_file_bytes=1 << 20)
    [path] = log_files(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    forged = json.loads(lines[-1])
    forged["completion_tokens"] = 0
    forged["hash"] = record_hash(forged)
    path.write_bytes(b"".join(lines[:-1]) + canonical(forged) + b"\n")
    assert "its hash is not the one its HEAD names" in verify(tmp_path).error


def test_a_log_without_its_head_file_fails_verify(tmp_path):
    write(tmp_path, n=5)
    (tmp_path / "HEAD").unlink()
    assert "no HEAD file" in verify(tmp_path).error


def test_a_log_recovered_after_a_crash_mid_batch_still_passes(tmp_path):
    write(tmp_path, n=10, max_file_bytes=1 << 20).close()
    [path] = log_files(tmp_path)
    with open(path, "ab") as f:  # a batch cut off by a crash: never acknowledged, HEAD not moved
        f.write(b'{"request_id": "r0010", "seq": 10, "pre')
    log = AuditLog(tmp_path, clock=Clock())
    assert verify(tmp_path).ok and verify(tmp_path).records == 10
    assert log.append([rec(10)]) == (1, 0)
    assert verify(tmp_path).ok and verify(tmp_path).records == 11


def test_records_past_the_head_from_a_crash_before_it_moved_pass_and_are_anchored_at_restart(tmp_path):
    log = write(tmp_path, n=10, max_file_bytes=1 << 20)
    old_head = (tmp_path / "HEAD").read_bytes()
    log.append([rec(10), rec(11)])
    log.close()
    (tmp_path / "HEAD").write_bytes(old_head)  # the crash came between the batch's fsync and HEAD's
    result = verify(tmp_path)
    assert (result.ok, result.records, result.unanchored) == (True, 12, 2)
    again = AuditLog(tmp_path, clock=Clock())
    assert json.loads((tmp_path / "HEAD").read_bytes())["seq"] == 11
    assert again.append([rec(11)]) == (0, 1)  # the unacknowledged batch's resend
    assert verify(tmp_path).unanchored == 0


def test_the_writer_does_not_start_on_a_log_whose_end_was_removed(tmp_path):
    write(tmp_path).close()
    log_files(tmp_path)[-1].unlink()
    with pytest.raises(getattr(audit_log, "AuditLogDamaged", ()), match="records were removed from its end"):
        AuditLog(tmp_path, max_file_bytes=4096, clock=Clock())


def test_an_anchor_kept_elsewhere_is_checked(tmp_path, capsys):
    log = write(tmp_path, n=20, max_file_bytes=1 << 20)
    anchor = (log.next_seq - 1, log.head)
    assert verify(tmp_path, anchor=anchor).ok
    assert main(["audit", "verify", str(tmp_path), "--anchor", f"{anchor[0]}:{anchor[1]}"]) == 0
    [path] = log_files(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-3]))  # the end cut away, HEAD rewritten to match: only the anchor knows
    last = json.loads(lines[-4])
    (tmp_path / "HEAD").write_text(json.dumps({"seq": last["seq"], "hash": last["hash"], "file": path.name}))
    assert verify(tmp_path).ok
    assert "the log ends at record seq 16 but the anchor names record seq 19" in verify(tmp_path, anchor=anchor).error
    assert main(["audit", "verify", str(tmp_path), "--anchor", f"{anchor[0]}:{anchor[1]}"]) == 1
    assert "the anchor names record seq 19" in capsys.readouterr().err


# ---- state outside /tmp; a spool not written by this server is refused (issue 39) ---------------------

def test_state_defaults_to_the_users_state_directory_not_tmp(tmp_path, monkeypatch):
    from cluster.config import AppConfig, AuditOptions, BudgetOptions
    from cluster.config.front_door import state_path

    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = AppConfig()
    assert "/tmp" not in json.dumps(cfg.audit.model_dump()) + json.dumps(cfg.budgets.model_dump())
    assert AuditOptions().log_dir() == tmp_path / "home/.local/state/pdserve/audit"
    assert AuditOptions().spool_directory() == tmp_path / "home/.local/state/pdserve/audit/spool"
    assert BudgetOptions().ledger_file() == tmp_path / "home/.local/state/pdserve/ledger.json"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # read at use, not when the config was built
    assert AuditOptions().log_dir() == tmp_path / "state/pdserve/audit"
    assert cfg.budgets.ledger_file() == tmp_path / "state/pdserve/ledger.json"
    assert state_path("~/audit", "audit") == tmp_path / "home/audit"  # an explicit path: `~` expanded
    assert AuditOptions(dir="/srv/a", spool_dir="~/s").spool_directory() == tmp_path / "home/s"


def test_the_default_shipper_spools_under_the_state_directory_in_a_private_directory(tmp_path, monkeypatch):
    import asyncio

    from cluster.config import AuditOptions
    from router.ingress.gateway.audit import AuditShipper

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    async def scenario():
        return AuditShipper(AuditOptions(enabled=True), lambda: None).spool.dir

    spool = asyncio.run(scenario())
    assert spool == tmp_path / "state/pdserve/audit/spool"
    assert spool.stat().st_mode & 0o777 == 0o700


def test_a_spool_directory_is_private(tmp_path):
    spool = Spool(tmp_path / "spool")
    assert spool.dir.stat().st_mode & 0o777 == 0o700


def test_a_spool_file_not_written_by_this_server_is_refused(tmp_path, caplog):
    def dead_spool(ids):
        s = Spool(tmp_path)
        for i in ids:
            s.add(rec(i))
        os.close(s._lock_fd)  # its process died
        return s

    planted_writable = dead_spool([100])  # a segment others may write: anyone could have put records in it
    for f in tmp_path.glob(f"{planted_writable.owner}.*.jsonl"):
        f.chmod(0o666)
    if os.geteuid() == 0:
        planted_foreign = dead_spool([200])  # owned by another user
        for f in tmp_path.glob(f"{planted_foreign.owner}.*"):
            os.chown(f, 65534, 65534)
    honest = dead_spool([1, 2])
    me = Spool(tmp_path)
    with caplog.at_level("ERROR", logger="router.ingress.gateway.audit"):
        assert me.adopt() == 2
    assert me.batch(10) == [rec(1), rec(2)]
    assert not list(tmp_path.glob(f"{honest.owner}.*"))
    assert list(tmp_path.glob(f"{planted_writable.owner}.*.jsonl"))  # left where it is, for someone to look at
    assert "writable by group or others" in caplog.text
    if os.geteuid() == 0:
        assert list(tmp_path.glob(f"{planted_foreign.owner}.*.jsonl")) and "not owned by" in caplog.text
    assert caplog.text.count("refused") == (2 if os.geteuid() == 0 else 1)
    caplog.clear()
    with caplog.at_level("ERROR", logger="router.ingress.gateway.audit"):
        assert me.adopt() == 0
    assert "refused" not in caplog.text  # said once, not at every adoption pass (5 s)


def test_a_symlinked_spool_file_is_refused(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(canonical(rec(7)) + b"\n")
    spool_dir = tmp_path / "spool"
    dead = Spool(spool_dir)
    os.close(dead._lock_fd)
    seg = spool_dir / f"{dead.owner}.0.jsonl"
    seg.unlink()
    seg.symlink_to(outside)
    me = Spool(spool_dir)
    assert me.adopt() == 0 and outside.exists()
