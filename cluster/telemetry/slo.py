"""Prometheus rules from the app's SLOs (`telemetry.slo`): SLIs as recording rules, error ratios and
burn rates per window, the error budget left, and the SRE workbook's multi-window, multi-burn-rate
alerts. `pdserve slo-rules` prints them; deploy/prometheus/pdserve-rules.yml is the defaults'
output, and a test regenerates it, so the objectives in the config and the rules cannot drift.

Every rule reads Ray's export names (`ray_pdserve_*`, cluster/telemetry/metrics.py) and aggregates
`by` bounded labels only (tenant, pool, replica, code, reason, slo), which drops Ray's per-worker
labels. `time_scale` shrinks every window and `for` (tests fit an hour into seconds); rule names
keep the nominal windows (`…:burn_rate1h` reads over 1h * time_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from cluster.config import SLOOptions

# What the availability SLI counts as the server's failure. Client errors (bad input, unknown key or
# model, quotas, cancelled by the client) are neither good nor bad; RESOURCE_EXHAUSTED is the
# server's only when the refusal's reason is overload rather than a tenant's quota.
CLIENT_CODES = ("INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "FAILED_PRECONDITION",
                "CANCELLED", "RESOURCE_EXHAUSTED")
SERVER_CODES = ("INTERNAL", "ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED")
OVERLOAD_REASONS = ("capacity", "queue_wait", "overloaded")
QUOTA_REASONS = ("concurrency", "requests_per_min", "tokens_per_min")

SLI_WINDOW = "5m"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class BurnAlert:
    """Fire when the burn rate exceeds `factor` over both windows of any pair (long, short)."""

    suffix: str
    severity: str
    pairs: tuple[tuple[float, str, str], ...]  # (factor, long window, short window)
    hold: str  # Prometheus `for`


# SRE workbook, ch. 5: 2% of a 30-day budget in 1h, or 5% in 6h, pages; 10% in 3 days is a ticket.
ALERTS = (
    BurnAlert("BudgetBurn", "page", ((14.4, "1h", "5m"), (6.0, "6h", "30m")), "2m"),
    BurnAlert("BudgetBurnTicket", "ticket", ((1.0, "3d", "6h"),), "15m"),
)
ALERT_NAMES = {"availability": "PdserveAvailability", "ttft": "PdserveTTFT", "itl": "PdserveITL"}

_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def seconds(duration: str) -> int:
    return int(float(duration[:-1]) * dict(_UNITS)[duration[-1]])


def duration(secs: float) -> str:
    """Prometheus duration, in the largest unit that divides it (at least 1s)."""
    secs = max(1, round(secs))
    unit, size = next((u, s) for u, s in _UNITS if secs % s == 0)
    return f"{secs // size}{unit}"


def _le(bound: float) -> str:
    return str(float(bound))  # Ray's exporter writes bucket bounds as Python floats: le="1.0"


def _or_list(words) -> str:
    return "|".join(words)


def _server_errors(w: str) -> str:
    return (f'rate(ray_pdserve_requests_total{{code=~"{_or_list(SERVER_CODES)}"}}[{w}]) or '
            f'rate(ray_pdserve_requests_rejected_total{{code="RESOURCE_EXHAUSTED",'
            f'reason=~"{_or_list(OVERLOAD_REASONS)}"}}[{w}])')


def _ok(w: str) -> str:
    return f'rate(ray_pdserve_requests_total{{code="OK"}}[{w}])'


def error_ratio(slo: str, opts: SLOOptions, w: str) -> str:
    """The fraction of bad events over window `w`, service-wide (what the alerts burn)."""
    if slo == "availability":
        return f"(sum({_server_errors(w)}) or 0 * sum({_ok(w)}))\n/\nsum({_ok(w)} or {_server_errors(w)})"
    metric, bound = {"ttft": ("ray_pdserve_ttft_seconds", opts.ttft_threshold_s),
                     "itl": ("ray_pdserve_inter_token_latency_seconds", opts.itl_threshold_s)}[slo]
    return (f'1 - sum(rate({metric}_bucket{{le="{_le(bound)}"}}[{w}]))\n'
            f'/\nsum(rate({metric}_count[{w}]))')


def objectives(opts: SLOOptions) -> dict[str, float]:
    return {"availability": opts.availability, "ttft": opts.ttft, "itl": opts.itl}


def _record(name: str, expr: str, **labels) -> dict:
    rule = {"record": name, "expr": expr}
    if labels:
        rule["labels"] = labels
    return rule


def sli_rules(scale: float) -> list[dict]:
    """Dashboards' and operators' SLIs over SLI_WINDOW, per tenant, pool or replica."""
    w = duration(seconds(SLI_WINDOW) * scale)
    n = SLI_WINDOW
    rules = [
        _record(f"pdserve:requests:rate{n}", f"sum by (tenant, code) (rate(ray_pdserve_requests_total[{w}]))"),
        _record(f"pdserve:availability:ratio_rate{n}",
                f"sum by (tenant) ({_ok(w)})\n/\nsum by (tenant) ({_ok(w)} or {_server_errors(w)})"),
        _record(f"pdserve:stream_completion:ratio_rate{n}",
                f'sum by (tenant) (rate(ray_pdserve_streams_total{{outcome="completed"}}[{w}]))\n/\n'
                f'sum by (tenant) (rate(ray_pdserve_streams_total{{outcome=~"completed|failed"}}[{w}]))'),
        _record(f"pdserve:refusals:rate{n}",
                f"sum by (tenant, code, reason) (rate(ray_pdserve_requests_rejected_total[{w}]))"),
    ]
    for name, metric, by in (("ttft_seconds", "ttft_seconds", "tenant"), ("tpot_seconds", "tpot_seconds", "tenant"),
                             ("itl_seconds", "inter_token_latency_seconds", "pool, replica"),
                             ("queue_time_seconds", "queue_time_seconds", "pool")):
        for q in QUANTILES:
            rules.append(_record(
                f"pdserve:{name}:quantile_rate{n}",
                f"histogram_quantile({q}, sum by (le, {by}) (rate(ray_pdserve_{metric}_bucket[{w}])))",
                quantile=str(q)))
    rules += [
        _record(f"pdserve:prefix_cache_hit:ratio_rate{n}",
                f"sum by (pool) (rate(ray_pdserve_prefix_cache_hit_tokens_total[{w}]))\n/\n"
                f"sum by (pool) (rate(ray_pdserve_prefix_cache_queried_tokens_total[{w}]))"),
        _record("pdserve:kv_usage:max", "max by (pool, replica) (ray_pdserve_kv_usage)"),
        _record(f"pdserve:generated_tokens:rate{n}",
                f"sum by (pool, replica) (rate(ray_pdserve_engine_generated_tokens_total[{w}]))"),
        _record(f"pdserve:computed_tokens:rate{n}",
                f"sum by (pool, replica) (rate(ray_pdserve_engine_computed_tokens_total[{w}]))"),
    ]
    return rules


def slo_rules(opts: SLOOptions, scale: float) -> list[dict]:
    """Per SLO and window: the error ratio and the burn rate (ratio / error budget); the budget left
    over the SLO period; the objective itself as a series."""
    windows = sorted({w for a in ALERTS for _, long, short in a.pairs for w in (long, short)}, key=seconds)
    period = duration(opts.period_days * 86400)
    rules = []
    for slo, objective in objectives(opts).items():
        budget = round(1 - objective, 12)
        rules.append(_record("pdserve:slo_objective:ratio", f"vector({objective:g})", slo=slo))
        for w in [*windows, period]:
            rules.append(_record(f"pdserve:slo_errors:ratio_rate{w}",
                                 error_ratio(slo, opts, duration(seconds(w) * scale)), slo=slo))
        for w in windows:
            rules.append(_record(f"pdserve:slo_errors:burn_rate{w}",
                                 f'pdserve:slo_errors:ratio_rate{w}{{slo="{slo}"}} / {budget:g}', slo=slo))
        rules.append(_record("pdserve:slo_error_budget_remaining:ratio",
                             f'1 - pdserve:slo_errors:ratio_rate{period}{{slo="{slo}"}} / {budget:g}', slo=slo))
    return rules


def budget_words(slo: str, opts: SLOOptions) -> str:
    return {"availability": f"more than {1 - opts.availability:.3%} of requests fail (client errors excluded)",
            "ttft": f"more than {1 - opts.ttft:.2%} of requests wait over {opts.ttft_threshold_s:g} s for a first token",
            "itl": f"more than {1 - opts.itl:.2%} of token intervals exceed {opts.itl_threshold_s:g} s"}[slo]


def alert_rules(opts: SLOOptions, scale: float) -> list[dict]:
    rules = []
    for slo, objective in objectives(opts).items():
        for alert in ALERTS:
            expr = "\nor\n".join(
                f'(pdserve:slo_errors:burn_rate{long}{{slo="{slo}"}} > {factor:g}\n'
                f' and pdserve:slo_errors:burn_rate{short}{{slo="{slo}"}} > {factor:g})'
                for factor, long, short in alert.pairs)
            windows = " or ".join(f"{f:g}x over {long} and {short}" for f, long, short in alert.pairs)
            rules.append({  # the annotations carry no $value: promtool's tests compare them exactly
                "alert": ALERT_NAMES[slo] + alert.suffix,
                "expr": expr,
                "for": duration(seconds(alert.hold) * scale),
                "labels": {"severity": alert.severity, "slo": slo},
                "annotations": {
                    "summary": f"pdserve {slo} SLO ({objective:g}) is burning its error budget: {windows}",
                    "description": f"{budget_words(slo, opts)}; see README, Observability, "
                                   f"alert {ALERT_NAMES[slo] + alert.suffix}",
                },
            })
    return rules


BUDGET_ALERT = "PdserveBudgetNearlySpent"


def budget_rules(alert_fraction: float, scale: float) -> list[dict]:
    """Spend alert: a tenant has used more than `alert_fraction` of its monthly budget (the ledger
    actor's gauges: settled + reserved spend, and the budget)."""
    return [{
        "alert": BUDGET_ALERT,
        "expr": f"max by (tenant) (ray_pdserve_budget_spent_usd)\n/\nmax by (tenant) (ray_pdserve_budget_limit_usd)"
                f" > {alert_fraction:g}",
        "for": duration(300 * scale),
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": f"a tenant has used more than {alert_fraction:.0%} of its monthly budget",
            "description": "at 100% its requests are refused (429 insufficient_quota) until the month ends; "
                           "`pdserve budget` shows each tenant's spend (README, Budgets)",
        },
    }]


def rules(opts: SLOOptions, time_scale: float = 1.0, budget_alert_fraction: float = 0.8) -> dict:
    return {"groups": [
        {"name": "pdserve-sli", "rules": sli_rules(time_scale)},
        {"name": "pdserve-slo", "rules": slo_rules(opts, time_scale)},
        {"name": "pdserve-slo-alerts", "rules": alert_rules(opts, time_scale)},
        {"name": "pdserve-budget-alerts", "rules": budget_rules(budget_alert_fraction, time_scale)},
    ]}


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as YAML literal blocks, as people write rule files."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render(opts: SLOOptions, time_scale: float = 1.0, budget_alert_fraction: float = 0.8) -> str:
    header = ("# Generated by `pdserve slo-rules` from telemetry.slo (cluster/config/telemetry.py): edit the config and\n"
              "# regenerate, never this file. See README, Observability.\n")
    if time_scale != 1.0:
        header += f"# time_scale {time_scale:g}: every window and `for` is shortened by it; names keep the nominal ones.\n"
    return header + yaml.dump(rules(opts, time_scale, budget_alert_fraction), Dumper=_Dumper, sort_keys=False,
                              width=120)
