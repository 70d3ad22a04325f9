"""deploy/prometheus/pdserve-rules.yml: the committed file is what `pdserve slo-rules` makes of the
default objectives; `promtool check rules` accepts it; and `promtool test rules` drives synthetic
series through it: each alert fires on a burn it must page or ticket for, and stays quiet on
client errors, on a slow burn below its factor, and once the burn has stopped (the short window)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.app.cli import main
from cluster.config import AppConfig, SLOOptions
from cluster.telemetry import slo
from router.ingress.status import Code

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "pdserve-rules.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: apt-get install -y prometheus (README, Observability)")


def test_the_committed_rules_are_what_the_default_objectives_generate(capsys):
    assert main(["slo-rules", "--config", str(RULES.parents[1] / "pdserve.yaml")]) == 0
    assert capsys.readouterr().out == RULES.read_text() == slo.render(AppConfig().telemetry.slo)


def test_every_status_code_is_the_client_s_or_the_server_s():
    assert set(slo.CLIENT_CODES) | set(slo.SERVER_CODES) == {c.grpc_name for c in Code}
    assert not set(slo.CLIENT_CODES) & set(slo.SERVER_CODES)
    assert not set(slo.OVERLOAD_REASONS) & set(slo.QUOTA_REASONS)  # a 429 is the server's only for overload


def test_latency_thresholds_must_be_bucket_bounds():
    with pytest.raises(ValueError, match="not a bucket bound"):
        SLOOptions(ttft_threshold_s=0.7)
    with pytest.raises(ValueError, match="not a bucket bound"):
        SLOOptions(itl_threshold_s=0.03)


def test_durations_scale_to_whole_seconds():
    assert [slo.duration(slo.seconds(w) / 12) for w in ("5m", "1h", "3d", "2m")] == ["25s", "5m", "6h", "10s"]
    assert slo.duration(30 * 86400) == "30d"


@needs_promtool
@pytest.mark.parametrize("time_scale", [1.0, 1 / 12])
def test_promtool_accepts_the_rules(tmp_path, time_scale):
    path = tmp_path / "rules.yml"
    path.write_text(slo.render(SLOOptions(), time_scale))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- promtool test rules ------------------------------------------------------------------------------

def alert(name: str) -> dict:
    """The expected firing alert, labels and annotations as the generated rule has them."""
    [rule] = [r for g in slo.rules(SLOOptions())["groups"] for r in g["rules"] if r.get("alert") == name]
    return {"exp_labels": rule["labels"], "exp_annotations": rule["annotations"]}


def counter(labels: str, per_min: float, minutes: int, then: float | None = None, after: int = 0) -> dict:
    """A counter growing `per_min` every minute for `minutes` (then `then` per minute for `after`)."""
    values = f"0+{per_min:g}x{minutes}"
    if then is not None:
        values += f" {per_min * minutes + then:g}+{then:g}x{after}"
    return {"series": labels, "values": values}


def requests(code: str, per_min: float, minutes: int = 240, **kw) -> dict:
    return counter(f'ray_pdserve_requests_total{{tenant="a",code="{code}"}}', per_min, minutes, **kw)


def latency(metric: str, le: str, good: float, total: float, minutes: int = 240) -> list[dict]:
    return [counter(f'ray_pdserve_{metric}_bucket{{le="{le}"}}', good, minutes),
            counter(f"ray_pdserve_{metric}_count", total, minutes)]


def case(series: list[dict], alerts: dict[str, dict[str, list]], exprs: tuple = ()) -> dict:
    """One test group: at each eval time, exactly the listed alerts fire (names absent: none do)."""
    return {"interval": "1m", "input_series": series, "promql_expr_test": list(exprs),
            "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": [alert(name)] if on else []}
                                for name, times in alerts.items() for t, on in times]}


PAGE, TICKET = "BudgetBurn", "BudgetBurnTicket"
A, T, I = slo.ALERT_NAMES["availability"], slo.ALERT_NAMES["ttft"], slo.ALERT_NAMES["itl"]

CASES = [
    # 2% of requests fail (20x the 0.1% budget): pages within minutes, tickets after its 15m hold
    case([requests("OK", 980), requests("INTERNAL", 20)],
         {A + PAGE: [("1m", False), ("10m", True)], A + TICKET: [("10m", False), ("30m", True)]}),
    # 0.5% fail (5x): below both page factors (14.4, 6), above the ticket's (1)
    case([requests("OK", 995), requests("UNAVAILABLE", 5)],
         {A + PAGE: [("3h", False)], A + TICKET: [("1h", True)]}),
    # 5% failed for 40 minutes, then none: the page stops once the 5m and 30m windows are clean,
    # though the 1h and 6h ones still hold the burst
    case([requests("OK", 950, 40, then=1000, after=200), requests("INTERNAL", 50, 40, then=0, after=200)],
         {A + PAGE: [("20m", True), ("80m", False)]}),
    # half the requests are the client's fault (bad input, quotas, cancels): no alert at all
    case([requests("OK", 500), requests("INVALID_ARGUMENT", 300), requests("RESOURCE_EXHAUSTED", 150),
          requests("CANCELLED", 50),
          counter('ray_pdserve_requests_rejected_total{tenant="a",code="RESOURCE_EXHAUSTED",reason="tokens_per_min"}',
                  150, 240)],
         {A + PAGE: [("1h", False), ("3h", False)], A + TICKET: [("3h", False)]},
         exprs=[{"expr": 'pdserve:availability:ratio_rate5m', "eval_time": "1h",
                 "exp_samples": [{"labels": 'pdserve:availability:ratio_rate5m{tenant="a"}', "value": 1}]}]),
    # refused for overload (capacity): the server's failure, 5% of requests
    case([requests("OK", 950), requests("RESOURCE_EXHAUSTED", 50),
          counter('ray_pdserve_requests_rejected_total{tenant="a",code="RESOURCE_EXHAUSTED",reason="capacity"}',
                  50, 240)],
         {A + PAGE: [("10m", True)]}),
    # 0.05% fail for 4h: no alert; half the budget of that rate is left (the budget as a series)
    case([requests("OK", 1999), requests("INTERNAL", 1)],
         {A + PAGE: [("4h", False)], A + TICKET: [("4h", False)]},
         exprs=[{"expr": 'round(pdserve:slo_error_budget_remaining:ratio{slo="availability"}, 0.01)',
                 "eval_time": "4h",
                 "exp_samples": [{"labels": '{slo="availability"}', "value": 0.5}]}]),
    # TTFT (1% budget): 20% of requests over 1 s pages; 3% over tickets only
    case(latency("ttft_seconds", "1.0", 80, 100), {T + PAGE: [("10m", True)], A + PAGE: [("10m", False)]}),
    case(latency("ttft_seconds", "1.0", 970, 1000), {T + PAGE: [("3h", False)], T + TICKET: [("1h", True)]}),
    # ITL (1% budget): half the token intervals over 0.1 s (a slowed decode replica) pages; 0.5% does not
    case(latency("inter_token_latency_seconds", "0.1", 5000, 10000),
         {I + PAGE: [("1m", False), ("10m", True)], I + TICKET: [("30m", True)]}),
    case(latency("inter_token_latency_seconds", "0.1", 9950, 10000),
         {I + PAGE: [("3h", False)]}),
    # a tenant at 85% of its budget for 10 minutes: the spend alert; one at 50%: none
    case([{"series": 'ray_pdserve_budget_spent_usd{tenant="a"}', "values": "85x20"},
          {"series": 'ray_pdserve_budget_limit_usd{tenant="a"}', "values": "100x20"},
          {"series": 'ray_pdserve_budget_spent_usd{tenant="b"}', "values": "50x20"},
          {"series": 'ray_pdserve_budget_limit_usd{tenant="b"}', "values": "100x20"}],
         {}) | {"alert_rule_test": [
             {"eval_time": "3m", "alertname": slo.BUDGET_ALERT, "exp_alerts": []},
             {"eval_time": "10m", "alertname": slo.BUDGET_ALERT, "exp_alerts": [
                 {**alert(slo.BUDGET_ALERT), "exp_labels": {**alert(slo.BUDGET_ALERT)["exp_labels"], "tenant": "a"}}]}]},
    # nothing at all: no alert (NaN ratios compare false)
    case([requests("OK", 0)], {name + suffix: [("1h", False)] for name in (A, T, I) for suffix in (PAGE, TICKET)}),
]


@needs_promtool
def test_each_alert_fires_when_it_must_and_not_when_it_must_not(tmp_path):
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": CASES}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
