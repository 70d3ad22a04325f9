"""Metrics and traces of a real local cluster (1 prefill + 1 decode replica, two tenants).

After a known set of requests, the `pdserve_*` series scraped from Ray's Prometheus endpoints (the
nodes' metrics agents, as Ray's own tests read them) have grown by exact amounts, and an OTLP
collector run here (the app exports with `telemetry.traces: otlp`) receives one trace per request
with its phase spans in order. Values are read as differences from a scrape taken before the
requests: the session's Ray instance keeps the series of earlier test modules' (dead) replicas.
"""

import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.kv_cache import extend_salt, hash_request_blocks
from cluster.engine.model.identity import model_identity
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.gateway.telemetry import refusal_reason
from tests.helpers import app_router, grpc_stub, serve_replica_ids, wait_for, wait_until

KEYS = {"tele-a": "sk-tele-a", "tele-b": "sk-tele-b"}
PREFIX = [256] + [(j * 3) % 250 for j in range(63)]  # 4 blocks of 16


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span with its service name."""

    def __init__(self):
        self.spans = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 — the RPC's name
        with self._lock:
            for rs in request.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
                for ss in rs.scope_spans:
                    self.spans += [(service, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self):
        with self._lock:
            return list(self.spans)


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(ThreadPoolExecutor(4))
    receiver = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("localhost:0")
    server.start()
    yield receiver, port
    server.stop(0)


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model, collector):
    with serve_apps.run(  # its own app: traces go to this module's collector; metrics counted by replica
        tiny_model, served_model_name="tiny", routing={"local_prefill_threshold": 16},
        tenants={name: {"api_keys": [key]} for name, key in KEYS.items()},
        telemetry={"traces": "otlp", "otlp_endpoint": f"localhost:{collector[1]}", "metrics_interval_s": 0.2,
                   "trace_export_delay_s": 0.2},
    ) as cfg:
        ids = serve_replica_ids()
        assert (len(ids["prefill"]), len(ids["decode"])) == (1, 1)
        replicas = {"prefill": ids["prefill"][0], "decode": ids["decode"][0]}
        router = app_router()
        # the router may still hold loads of an earlier module's replicas: wait for exactly ours
        wait_until(lambda: {x.replica_id for x in ray.get(router.live_loads.remote())} == set(replicas.values()),
                   "the router to know exactly this app's replicas")
        yield cfg, replicas


# ---- reading Ray's Prometheus endpoints -------------------------------------------------------------


def scrape() -> list[tuple[str, dict, float]]:
    """Every sample of every alive node's metrics agent."""
    samples = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            samples += [(s.name, s.labels, s.value) for s in family.samples if s.name.startswith("ray_pdserve_")]
    return samples


def total(samples, name: str, labels: dict) -> float:
    """The sum over all series of `name` whose labels include `labels` (across workers and nodes)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def grown(before, after, expected: dict) -> dict:
    return {key: total(after, key[0], dict(key[1])) - total(before, key[0], dict(key[1])) for key in expected}


def key(name: str, **labels) -> tuple:
    return ("ray_pdserve_" + name, tuple(sorted(labels.items())))


# ---- the known set of requests ------------------------------------------------------------------------


def generate(stub, ids, max_tokens, tenant, request_id):
    req = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(stub.Generate(req, timeout=60, metadata=[("authorization", f"Bearer {KEYS[tenant]}")]))[-1]


@pytest.fixture(scope="module")
def scenario(server, tiny_model):
    """Four requests that run (two remote prefills, two local ones, one crafted prefix hit on each
    pool), one refused as bad input, one with an unknown key. Returns the scrapes around them."""
    cfg, replicas = server
    router = app_router()
    salt = extend_salt(model_identity(tiny_model).encode(), "tele-a")
    prefix_hashes = set(hash_request_blocks(PREFIX, 16, salt))

    def router_holds_prefix(pool):
        return lambda: prefix_hashes <= ray.get(router.hashes.remote(replicas[pool]))

    before = scrape()
    usage = {}
    with grpc_stub(cfg) as stub:
        # r1: 70 tokens, nothing cached anywhere: prefilled remotely, 5 blocks pulled
        usage["r1"] = generate(stub, PREFIX + list(range(1, 7)), 6, "tele-a", "tele-r1").usage
        wait_until(router_holds_prefix("decode"), "the decode replica's imported blocks in the router")
        wait_until(router_holds_prefix("prefill"), "the prefill replica's blocks in the router")
        # r2: the same 70 tokens: decode holds 64, lacks 6 < 16: prefilled on decode, 64 cached there
        usage["r2"] = generate(stub, PREFIX + list(range(1, 7)), 6, "tele-a", "tele-r2").usage
        # r3: the prefix + 30 new tokens: remote, 64 cached on prefill; decode reuses 4 blocks, pulls 2
        usage["r3"] = generate(stub, PREFIX + list(range(7, 37)), 6, "tele-a", "tele-r3").usage
        # r4: another tenant's 8-token prompt: prefilled on decode
        usage["r4"] = generate(stub, [256, 3, 1, 4, 1, 5, 9, 2], 4, "tele-b", "tele-r4").usage
        with pytest.raises(grpc.RpcError) as bad:  # r5: 8 + 600 tokens exceed the context of 512
            generate(stub, [256, 3, 1, 4, 1, 5, 9, 2], 600, "tele-b", "tele-r5")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as unknown:
            list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), timeout=60,
                               metadata=[("authorization", "Bearer sk-nobody")]))
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert {r: (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens) for r, u in usage.items()} == {
        "r1": (70, 6, 0), "r2": (70, 6, 64), "r3": (94, 6, 64), "r4": (8, 4, 0)}
    return before, replicas


def test_counters_and_histogram_counts_grow_by_exactly_what_the_requests_did(scenario):
    before, replicas = scenario
    # the flow's metrics carry the model version that served (this app's: model tiny, no version label);
    # a refusal at the edge, before any model was chosen, carries empty ones; rejections only the tenant
    served = {"model": "tiny", "version": ""}
    a, b, unknown = {"tenant": "tele-a", **served}, {"tenant": "tele-b", **served}, {"tenant": "unknown", "model": "",
                                                                                     "version": ""}
    pre = {"pool": "prefill", "replica": replicas["prefill"]}
    dec = {"pool": "decode", "replica": replicas["decode"]}
    expected = {
        # ingress: per tenant, what clients saw
        key("requests_total", **a, code="OK"): 3,
        key("requests_total", **b, code="OK"): 1,
        key("requests_total", **b, code="INVALID_ARGUMENT"): 1,
        key("requests_rejected_total", tenant="tele-b", code="INVALID_ARGUMENT", reason="max_tokens"): 1,
        key("requests_total", **unknown, code="UNAUTHENTICATED"): 1,
        key("requests_rejected_total", tenant="unknown", code="UNAUTHENTICATED", reason="unauthenticated"): 1,
        key("streams_total", **a, outcome="completed"): 3,  # refusals never start a stream
        key("streams_total", **b, outcome="completed"): 1,
        key("streams_total", **b, outcome="failed"): 0,
        key("prompt_tokens_total", **a): 70 + 70 + 94,
        key("prompt_tokens_total", **b): 8,
        key("generation_tokens_total", **a): 18,
        key("generation_tokens_total", **b): 4,
        key("cached_prompt_tokens_total", **a): 64 + 64,
        key("cached_prompt_tokens_total", **b): 0,
        key("ttft_seconds_count", **a): 3,
        key("ttft_seconds_count", **b): 1,
        key("tpot_seconds_count", **a): 3,
        key("e2e_latency_seconds_count", **b): 1,
        # routing, as the router predicted it
        key("route_decisions_total", reason="load"): 1,  # r1
        key("route_decisions_total", reason="local_prefill"): 2,  # r2, r4
        key("route_decisions_total", reason="cache"): 1,  # r3
        key("route_decisions_total", reason="fallback"): 0,
        key("route_latency_seconds_count"): 4,
        key("route_prompt_tokens_total"): 70 + 70 + 94 + 8,
        key("route_predicted_cached_tokens_total"): 64 + 64,
        # prefill replica: r1, r3 (one step each)
        key("queue_time_seconds_count", **pre): 2,
        key("prefill_time_seconds_count", **pre): 2,
        key("batch_size_count", **pre): 2,
        key("tokens_per_step_bucket", **pre, le="32.0"): 1,  # r3: 30 uncached tokens
        key("tokens_per_step_bucket", **pre, le="128.0"): 2,  # r1: 70 (cumulative buckets)
        key("prefix_cache_queried_tokens_total", **pre): 70 + 94,
        key("prefix_cache_hit_tokens_total", **pre): 64,
        key("engine_computed_tokens_total", **pre): 70 + 30,
        key("engine_generated_tokens_total", **pre): 2,
        key("kv_leases_total", **pre, event="granted"): 2,
        key("kv_leases_total", **pre, event="released"): 2,
        key("kv_leases_total", **pre, event="expired"): 0,
        # decode replica: r1, r3 imported (5 tokens each); r2, r4 prefilled here (6 and 4 tokens)
        key("inter_token_latency_seconds_count", **dec): 4 + 5 + 4 + 3,
        key("kv_import_seconds_count", **dec): 2,
        key("queue_time_seconds_count", **dec): 2,
        key("prefill_time_seconds_count", **dec): 2,
        key("batch_size_count", **dec): 5 + 6 + 5 + 4,
        key("prefix_cache_queried_tokens_total", **dec): 70 + 8,
        key("prefix_cache_hit_tokens_total", **dec): 64,
        key("engine_computed_tokens_total", **dec): 5 + (6 + 5) + 5 + (8 + 3),
        key("engine_generated_tokens_total", **dec): 20,
        key("engine_finished_requests_total", **dec, reason="length"): 4,
        key("kv_transfer_pulls_total", **dec, result="ok"): 2,
        key("kv_transfer_pulls_total", **dec, result="failed"): 0,
        key("kv_transfer_blocks_total", **dec, kind="pulled"): 5 + 2,
        key("kv_transfer_blocks_total", **dec, kind="reused"): 4,
        key("preemptions_total", **dec): 0,
        # r1-r4's decode legs, each counted once by how its outputs went (every path: framed + streamed;
        # r1's may stream: its call starts the replica's connect to this ingress); none fell back
        key("decode_reply_legs_total", **dec): 4,
        key("decode_reply_legs_total", **dec, path="fell_back"): 0,
    }
    last = {}

    def settled():
        last.update(grown(before, scrape(), expected))
        return last == expected

    try:
        wait_for(settled, "the metrics to reach their expected values", timeout=45)
    except AssertionError:
        assert {k: v for k, v in last.items() if v != expected[k]} == {
            k: v for k, v in expected.items() if last.get(k) != v}
    # KV usage is a gauge per replica: every block is free again
    after = scrape()
    assert total(after, "ray_pdserve_kv_usage", dec) == 0.0
    bytes_pulled = total(after, "ray_pdserve_kv_transfer_bytes_total", dec) - total(
        before, "ray_pdserve_kv_transfer_bytes_total", dec)
    assert bytes_pulled > 0 and bytes_pulled % 7 == 0  # 7 blocks of one size


def test_each_request_is_one_trace_with_its_phase_spans_in_order(scenario, collector):
    receiver, _ = collector
    expected = {
        "tele-r1": ["ingress", "route", "queue", "prefill", "transfer", "decode"],
        "tele-r2": ["ingress", "route", "queue", "prefill", "decode"],
        "tele-r3": ["ingress", "route", "queue", "prefill", "transfer", "decode"],
        "tele-r4": ["ingress", "route", "queue", "prefill", "decode"],
        "tele-r5": ["ingress"],
    }
    where = {"ingress": "pdserve-ingress", "route": "pdserve-ingress", "transfer": "pdserve-decode",
             "decode": "pdserve-decode"}

    def traces():
        roots = {}
        for _, span in receiver.snapshot():
            if span.name == "ingress":
                rid = {a.key: a.value.string_value for a in span.attributes}["pdserve.request_id"]
                roots[rid] = span
        by_trace = {}
        for service, span in receiver.snapshot():
            by_trace.setdefault(span.trace_id, []).append((service, span))
        return {rid: sorted(by_trace[root.trace_id], key=lambda s: s[1].start_time_unix_nano)
                for rid, root in roots.items()}

    wait_for(lambda: {rid: [s.name for _, s in spans] for rid, spans in traces().items()} == expected,
             "one trace per request with its phase spans", timeout=30)
    found = traces()
    assert len({spans[0][1].trace_id for spans in found.values()}) == len(expected)
    for rid, spans in found.items():
        root = spans[0][1]
        assert root.parent_span_id == b""
        assert all(s.parent_span_id == root.span_id for _, s in spans[1:])
        assert all(s.end_time_unix_nano >= s.start_time_unix_nano for _, s in spans)
        remote = "transfer" in expected[rid]
        for service, s in spans:
            pool = "pdserve-prefill" if remote and s.name in ("queue", "prefill") else "pdserve-decode"
            assert service == where.get(s.name, pool), (rid, s.name)
    assert found["tele-r5"][0][1].status.code == 2  # STATUS_CODE_ERROR: refused as bad input


def test_the_grafana_dashboard_queries_what_the_catalogue_exports():
    """Every series deploy/grafana/pdserve.json queries is exported under that name (Ray adds `ray_`,
    counters end in `_total`, histograms in `_bucket`/`_count`/`_sum`: the scrapes above read these
    names from Ray's endpoints), and every pdserve_* metric is on the dashboard."""
    root = Path(__file__).resolve().parents[2]
    source = (root / "cluster" / "telemetry" / "metrics.py").read_text()
    catalogue = {name: kind for kind, name in re.findall(r'(Counter|Gauge|Histogram)\(\s*"(pdserve_\w+)"', source)}
    suffixes = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_count", "_sum")}
    exported = {f"ray_{name}{s}": name for name, kind in catalogue.items() for s in suffixes[kind]}
    dashboard = json.loads((root / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    queried = {m for e in exprs for m in re.findall(r"ray_pdserve_\w+", e)}
    assert len(catalogue) == 50  # 34 + 6 (audit, budgets) + 4 (speculative decoding) + 2 (guardrails, response cache) + 2 (router feed) + 1 (poison containment) + 1 (decode replies)
    assert queried - set(exported) == set()
    assert set(catalogue) - {exported[m] for m in queried} == set()


def test_a_refusal_reason_is_the_top_level_field_so_its_label_stays_bounded():
    reasons = {refusal_reason(InvalidRequestError(field, "x"))
               for field in ("messages.3.content.0.text", "messages.255.content", "messages", "max_tokens")}
    assert reasons == {"messages", "max_tokens"}
