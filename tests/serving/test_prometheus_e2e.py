"""The rules and the dashboard against a real Prometheus scraping a real cluster (1 prefill + 1 decode).

The test starts Prometheus on a free loopback port with a generated config (scrape every 5 s with a
5 s timeout, evaluate every second; targets: every alive node's Ray metrics agent) and the rules of `pdserve slo-rules` shortened
by TIME_SCALE (1/12: the "5m" window reads 25 s, "1h" 5 min, the page alert's 2 m hold 10 s), so an
hour of burn fits the test. After a bounded load, every query of deploy/grafana/pdserve.json and
every recording rule returns a series; then fault injection slows the decode replica (0.15 s per
step against the ITL objective's 0.1 s), slows the prefill replica (1.2 s per step against TTFT's
1 s) and drops every KV pull (failure policy "fail": requests fail, against availability), and
PdserveITLBudgetBurn, PdserveTTFTBudgetBurn and PdserveAvailabilityBudgetBurn each go pending, then
firing. Ray's agents export every 10 s (metrics_report_interval_ms), which sets the pace. (A 1 s
scrape, whose timeout is then 1 s, lost the head node's target after a full suite run: its metrics
page had grown with every Serve replica of the session, and it answered too slowly under load.)
"""

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
import yaml

from cluster.config import AppConfig
from cluster.telemetry import slo
from cluster.tools.netutil import free_port
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, wait_for

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
TIME_SCALE = 1 / 12
RATE_INTERVAL = "30s"  # Grafana's $__rate_interval: at least two of Ray's 10 s exports

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed: apt-get install -y prometheus (README, Observability)")


# The load runs as tenant "metered" (a monthly budget, so the budget panels have series); the
# audit log is on (its panel's series).
METADATA = [("authorization", "Bearer k-metered")]


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    with serve_apps.run(  # its own app: the module injects faults and reads the series from zero
        tiny_model, served_model_name="tiny", engine={"num_blocks": 128}, routing={"local_prefill_threshold": 16},
        kv_transfer={"failure_policy": "fail"}, fault_tolerance={"fault_injection": True},
        telemetry={"metrics_interval_s": 0.2},
        tenants={"metered": {"api_keys": ["k-metered"], "monthly_budget_usd": 1000.0}},
        audit={"enabled": True, "dir": str(state / "audit")},
        budgets={"prices": {"tiny": {"prompt_per_1k": 0.01, "completion_per_1k": 0.03}},
                 "ledger_path": str(state / "ledger.json")},
    ) as cfg, grpc_stub(cfg) as stub:
        yield cfg, stub


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def series(self, expr: str) -> list:
        return self.get("/api/v1/query", query=expr)["result"]

    def alert_states(self, name: str) -> set[str]:
        return {a["state"] for a in self.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name}


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory):
    home = tmp_path_factory.mktemp("prometheus")
    (home / "rules.yml").write_text(slo.render(app[0].telemetry.slo, TIME_SCALE))
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]
    (home / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "5s", "scrape_timeout": "5s", "evaluation_interval": "1s"},
        "rule_files": [str(home / "rules.yml")],
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}]}))
    port = free_port()
    log = (home / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={home / 'prometheus.yml'}",
                             f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")
        wait_for(lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200,
                 f"Prometheus to be ready (log: {home / 'prometheus.log'})", timeout=30, retry_on=(OSError,))
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


PREFIX = [256] + [(j * 7) % 250 for j in range(47)]  # 3 blocks shared by every prompt: prefix-cache hits


def generate(stub, i: int, new_tokens: int = 24, max_tokens: int = 12) -> None:
    """24 new tokens after the shared prefix are prefilled remotely (> 16); 8 on the decode replica
    that holds the prefix (imported by earlier requests)."""
    ids = PREFIX + [(i * 13 + j) % 250 for j in range(new_tokens)]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    list(stub.Generate(req, metadata=METADATA, timeout=60))


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    found = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    found += [(f"variable {v['name']}", v["definition"].removeprefix("label_values(").rsplit(",", 1)[0])
              for v in board["templating"]["list"] if "definition" in v]
    subst = {"$__rate_interval": RATE_INTERVAL, "$SessionName": ".*", "$tenant": ".*", "$pool": ".*"}
    for old, new in subst.items():
        found = [(title, expr.replace(old, new)) for title, expr in found]
    return found


def recording_rules() -> list[str]:
    groups = slo.rules(AppConfig().telemetry.slo)["groups"]
    return sorted({r["record"] + (f'{{slo="{r["labels"]["slo"]}"}}' if "slo" in r.get("labels", {}) else "")
                   for g in groups for r in g["rules"] if "record" in r})


def test_dashboard_and_rules_return_series_and_injected_faults_fire_the_page_alerts(app, prometheus):
    started = time.monotonic()
    cfg, stub = app
    # a bounded load: 24 requests, 4 at a time, and one refused as bad input (a refusal series)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: generate(stub, i), range(24)))
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(
            max_tokens=5000)), metadata=METADATA, timeout=60))

    queries = dashboard_queries() + [(name, name) for name in recording_rules()]
    empty: list[str] = []

    def all_have_series() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in queries if not prometheus.series(expr)]
        return not empty

    try:
        wait_for(all_have_series, "every dashboard query and recording rule to return a series", timeout=45)
    except AssertionError:
        # say why: the scrape targets' health and what Prometheus holds of pdserve at all
        targets = [(t["scrapeUrl"], t["health"], t["lastError"])
                   for t in prometheus.get("/api/v1/targets")["activeTargets"]]
        names = sorted({r["metric"]["__name__"] for r in prometheus.series('{__name__=~"ray_pdserve_.*"}')})
        assert empty == [], f"targets {targets}; pdserve series held: {names}"

    # three faults at once, under 16 streams (half prefilled remotely, half on decode):
    # - every decode step 0.15 s: the decode-prefilled requests break ITL (99% of intervals <= 0.1 s);
    # - every prefill step 1.2 s: the remote requests' first tokens break TTFT (99% <= 1 s);
    # - every KV pull dropped, with kv_transfer.failure_policy "fail": the remote requests then fail
    #   (availability 99.9%).
    from ray import serve

    handles = {pool: serve.get_deployment_handle(pool, "pdserve") for pool in ("prefill", "decode")}
    handles["decode"].inject_fault.remote(step_delay_s=0.15, pull="drop").result(timeout_s=30)
    handles["prefill"].inject_fault.remote(step_delay_s=1.2).result(timeout_s=30)
    stop = threading.Event()
    failed: list[grpc.StatusCode] = []

    def load(k: int) -> None:
        i = 1000 + k
        while not stop.is_set():
            try:
                generate(stub, i, new_tokens=24 if k % 2 else 8)
            except grpc.RpcError as e:
                failed.append(e.code())
            i += 16

    alerts = [slo.ALERT_NAMES[name] + "BudgetBurn" for name in ("itl", "ttft", "availability")]
    seen: dict[str, list[tuple[float, frozenset]]] = {name: [] for name in alerts}
    workers = ThreadPoolExecutor(16)
    try:
        futures = [workers.submit(load, k) for k in range(16)]

        def firing() -> bool:
            for name in alerts:
                states = frozenset(prometheus.alert_states(name))
                if not seen[name] or seen[name][-1][1] != states:
                    seen[name].append((round(time.monotonic() - started, 1), states))
            return all(seen[name][-1][1] == {"firing"} for name in alerts)

        wait_for(firing, f"{alerts} to fire (states seen: {seen})", timeout=60)
    finally:
        stop.set()
        workers.shutdown(wait=True)
        handles["decode"].inject_fault.remote(step_delay_s=0.0, pull="none").result(timeout_s=30)
        handles["prefill"].inject_fault.remote(step_delay_s=0.0).result(timeout_s=30)
    for f in futures:
        f.result()
    print(f"alert states (s since the load began): {seen}; failed requests: {len(failed)} {set(failed)}")
    assert failed  # the dropped pulls failed requests (the clients saw it)
    for name in alerts:
        states = [s for _, s in seen[name]]
        pending, firing = frozenset({"pending"}), frozenset({"firing"})
        assert pending in states and states.index(pending) < states.index(firing), (name, seen[name])
