"""The chaos soak's accounting (cluster/tools/bench/chaos.py), on a real audit log: what it calls
missing, duplicated and hung is what the clients saw against what the log holds."""

import json

from cluster.tools.bench.chaos import Outcome, Report, audit_check
from router.ingress.gateway.audit_log import AuditLog, log_files


def record(rid: str, client_id: str, code: str = "OK") -> dict:
    return {"request_id": rid, "client_request_id": client_id, "code": code}


def test_audit_check_counts_missing_duplicated_and_failed_records(tmp_path):
    log = AuditLog(tmp_path)
    log.append([record("r1", "chaos-1"), record("r2", "chaos-2"), record("r3", "chaos-3", "UNAVAILABLE"),
                record("r4", "chaos-4"), record("r5", "chaos-4")])
    log.close()
    outcomes = [Outcome("greedy", "chaos-1", "OK", 0.1, identical=True),
                Outcome("n2", "chaos-2", "OK", 0.1, choices=2),  # one of its two choices has no record
                Outcome("greedy", "chaos-3", "UNAVAILABLE", 0.1),
                Outcome("n2", "chaos-4", "OK", 0.1, choices=2),
                Outcome("json", "chaos-5", "OK", 0.1)]  # none at all
    assert audit_check(str(tmp_path), outcomes) == {
        "chain_ok": True, "chain_error": None, "records": 5, "missing": 2, "duplicated": 0,
        "failed_with_record": 1}


def test_audit_check_sees_a_request_written_twice_and_a_broken_chain(tmp_path):
    AuditLog(tmp_path).append([record("r1", "chaos-1")])
    [f] = log_files(tmp_path)
    line = f.read_bytes()
    f.write_bytes(line + line)  # the same record again: its request id twice, and the chain broken
    result = audit_check(str(tmp_path), [Outcome("greedy", "chaos-1", "OK", 0.1)])
    assert (result["duplicated"], result["missing"], result["chain_ok"]) == (1, 0, False)
    assert "expected seq 1" in result["chain_error"]


def test_summary_counts_hung_calls_and_identical_greedy_tokens():
    report = Report(outcomes=[Outcome("greedy", "a", "OK", 1.0, identical=True),
                              Outcome("long", "b", "OK", 1.0, identical=False),
                              Outcome("greedy", "c", "HUNG", 150.0),
                              Outcome("json", "d", "UNAVAILABLE", 0.1, detail="no ingress")],
                    faults=[(1.0, "kill_router", "x"), (2.0, "kill_router", "x")])
    s = report.summary()
    assert (s["sent"], s["completed"], s["greedy_identical"], s["greedy_completed"], s["hung"]) == (4, 2, 1, 2, 1)
    assert s["failed"] == {"HUNG": 1, "UNAVAILABLE": 1}
    assert s["failures"] == {"UNAVAILABLE: no ingress": 1}
    assert s["faults"] == {"kill_router": 2}
    assert json.loads(json.dumps(s)) == s  # the report is written as JSON, whole
