"""The ledger's journal (issue 52): one appended line and one fsync per durable change, whatever the
ledger's size; a restart replays snapshot + journal to the same state exactly (month rollover,
expiries and a ttl change included); a torn last line is dropped, not fatal; the journal is
compacted into a snapshot at its bound; a file from before the journal still loads."""

import json
import os
import random

import pytest

from router.ingress.gateway.budget import Ledger, next_month_start

T0 = 1_795_000_000.0  # 2026-11-18 UTC


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


def _traffic(ledger: Ledger, clock: Clock, n: int, seed: int = 0) -> None:
    """n calls of every verb, time moving on (past expiries, into the next month), saved in batches."""
    rng = random.Random(seed)
    for i in range(n):
        clock.t += rng.choice([0.0, 1.0, 30.0, 200.0])
        if i == n // 2:
            clock.t = next_month_start(clock.t) + 5
            ledger.ttl_s = 100.0  # a redeploy's reservation_ttl_s, mid-journal
        tenant, rid = rng.choice("abc"), f"r{rng.randrange(n)}"
        verb = rng.choice(["reserve", "settle", "charge", "finish", "snapshot"])
        if verb == "reserve":
            ledger.reserve(tenant, rid, rng.randrange(1, 5_000), 200_000)
        elif verb == "snapshot":
            ledger.snapshot()
        else:
            getattr(ledger, verb)(tenant, rid, rng.randrange(0, 3_000))
        if rng.random() < 0.3:
            ledger.save()
    ledger.save()


def test_a_restart_replays_the_journal_to_the_same_state_exactly(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "l.json", reservation_ttl_s=300.0, clock=clock)
    _traffic(ledger, clock, 400)
    assert not (tmp_path / "l.json").exists()  # no snapshot yet: everything is in the journal
    assert ledger.history and ledger.month == "2026-12"  # the traffic crossed a month
    again = Ledger(tmp_path / "l.json", reservation_ttl_s=300.0, clock=Clock(clock.t))
    assert again.to_json() == ledger.to_json()
    assert again.snapshot() == ledger.snapshot()


def test_one_line_and_one_fsync_per_save_whatever_the_ledgers_size(tmp_path, monkeypatch):
    clock = Clock()
    ledger = Ledger(tmp_path / "l.json", clock=clock)
    for i in range(2_000):  # a big ledger: 2,000 open reservations
        ledger.reserve("t", f"open{i}", 1, 10**9)
    ledger.save()
    journal = tmp_path / "l.json.journal"
    fsyncs = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real(fd)))
    before = journal.stat().st_size
    ledger.settle("t", "open7", 1)
    ledger.save()
    line = journal.read_bytes()[before:]
    assert len(fsyncs) == 1 and line.count(b"\n") == 1 and len(line) < 200
    assert json.loads(line)["op"] == "settle" and json.loads(line)["seq"] == 2_001


def test_a_torn_last_line_is_dropped_and_cut_before_the_next_append(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "l.json", clock=clock)
    ledger.reserve("t", "a", 100, 1_000)
    ledger.charge("t", "b", 7)
    ledger.save()
    journal = tmp_path / "l.json.journal"
    whole = journal.read_bytes()
    for torn in (b'{"seq": 3, "at": 1795000000.0, "op": "cha', b"\0\0\0\0\n"):  # a crash mid-write
        journal.write_bytes(whole + torn)
        again = Ledger(tmp_path / "l.json", clock=Clock())
        assert again.to_json() == ledger.to_json() and journal.read_bytes() == whole + torn  # reading never writes
        again.charge("t", "c", 5)
        again.save()
        assert journal.read_bytes().count(b"\n") == 3 and journal.read_bytes().startswith(whole)
        third = Ledger(tmp_path / "l.json", clock=Clock())
        assert third.snapshot()["tenants"]["t"]["spent_usd"] == 12e-6 and third.seq == 3

    journal.write_bytes(b"garbage\n" + whole)  # not the last line: corruption, refused by name
    with pytest.raises(ValueError, match=r"budgets\.ledger_path: .*l\.json\.journal line 1 is corrupt"):
        Ledger(tmp_path / "l.json")
    journal.write_bytes(whole.split(b"\n")[1] + b"\n")  # seq 2 with seq 1 missing
    with pytest.raises(ValueError, match=r"line 1 has seq 2, expected 1: records are missing"):
        Ledger(tmp_path / "l.json")


def test_the_journal_is_compacted_at_its_bound_and_a_crash_mid_compaction_loses_nothing(tmp_path):
    clock = Clock()
    bound = 4096
    ledger = Ledger(tmp_path / "l.json", clock=clock, compact_bytes=bound)
    journal = tmp_path / "l.json.journal"
    size, snapshots = 0, 0
    for i in range(300):
        clock.t += 1
        ledger.charge("t", "c", 1)  # once; the repeats are recorded too (a small snapshot: the bound stays 4 KiB)
        line = len(ledger.pending[0]) + 1
        full = (journal.read_bytes() if journal.exists() else b"") + (ledger.pending[0] + "\n").encode()
        ledger.save()
        if size + line > bound:  # past the bound: a snapshot, and an empty journal
            assert journal.stat().st_size == 0 and json.loads((tmp_path / "l.json").read_text())["seq"] == i + 1
            snapshots, last_journal = snapshots + 1, full
        else:
            assert journal.stat().st_size == size + line <= bound
        size = journal.stat().st_size
    assert snapshots == 6  # 300 lines of 83-85 bytes: a snapshot every 49th
    assert Ledger(tmp_path / "l.json", clock=Clock(clock.t)).to_json() == ledger.to_json()

    # a crash after the snapshot's rename, before the journal's truncation: its lines are skipped
    journal.write_bytes(last_journal + journal.read_bytes())
    assert Ledger(tmp_path / "l.json", clock=Clock(clock.t)).to_json() == ledger.to_json()


def test_a_ledger_file_from_before_the_journal_loads(tmp_path):
    old = {"month": "2026-11", "tenants": {"t": {"spent": 5, "reserved": {"r": [9, T0]}, "budget": 100}},
           "history": {}, "charged": ["x"]}
    (tmp_path / "l.json").write_text(json.dumps(old))
    ledger = Ledger(tmp_path / "l.json", clock=Clock())
    assert ledger.settle("t", "r", 3) is True and ledger.charge("t", "x", 1) is False
    ledger.save()
    again = Ledger(tmp_path / "l.json", clock=Clock())
    assert again.tenants == {"t": {"spent": 8, "reserved": {}, "budget": 100}} and again.seq == 2
