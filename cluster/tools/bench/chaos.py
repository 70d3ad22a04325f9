"""A chaos soak (issue 52, item 6): the app `pdserve up` deploys, with several replicas of each pool,
under mixed traffic, while a seeded schedule kills its parts and drops its KV pulls.

    python -m cluster.tools.bench.chaos [--minutes 10] [--seed 0] [--model smollm2|random]
        [--prefill 2] [--decode 2] [--decode-tp 1] [--clients 4] [--fault-every 20] [--json FILE]

The app: `--prefill` prefill and `--decode` decode replicas (decode at tensor-parallel `--decode-tp`),
two tenants with keys (one with a monthly budget, so every request reserves and settles on the
ledger), audit on (a fresh directory), fault injection on, `fault_tolerance.replica_wait_s` 30 s.
Traffic, closed loop from `--clients` threads over gRPC (a client waits out a refusal's retry-after,
at most 5 s, and 0.5 s after UNAVAILABLE, as a retrying client would), each request one of:
- greedy: a prompt of 1-300 token ids, 16 tokens, temperature 0: its tokens must equal the
  in-process engine's on the same checkpoint (computed before the app starts);
- long: the same with a prompt of 700-1,000 ids;
- n2: a sampled request with n=2 and a seed (both choices must end);
- json: a chat with `response_format: json_object` (a choice ending in STOP must parse as JSON);
- cancel: a stream the client cancels after its first response.
Faults, one every `--fault-every` s (seeded): kill a prefill or decode replica, the router, the
admission, audit-writer or ledger actor, or an ingress (Serve and Ray bring each back); drop one decode
replica's NIXL pulls for 3 s; with `--decode-tp` > 1 also kill a tensor-parallel worker rank (its Ray actor).

Reported: requests sent; completed, and of the greedy ones identical to the reference; failed, by
gRPC code; hung (a call no server status ended within its client deadline of 150 s: must be 0);
KV blocks and prefill leases still held once the load stops and every pool has had lease_s + 30 s
to settle (must be 0); audit records missing for a request the client saw complete, or written twice
(must be 0), and the log's hash chain verified. The load generator's own CPU is printed: it shares
the machine's cores with the app.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

BACKOFF_S = 0.5  # a client's pause after UNAVAILABLE (no ingress: one was killed), or a refusal without retry-after
MAX_RETRY_AFTER_S = 5.0
HUNG_AFTER_S = 150.0  # the client's deadline: far past replica_wait_s (30) + a request's own work
KINDS = {"greedy": 40, "long": 10, "n2": 15, "json": 20, "cancel": 15}
FAULTS = {"kill_prefill": 3, "kill_decode": 3, "kill_router": 2, "kill_admission": 1, "kill_audit": 1,
          "kill_ledger": 1, "kill_ingress": 1, "drop_pulls": 2, "kill_tp_rank": 2}
KILL_SERVE = {"kill_prefill": "prefill", "kill_decode": "decode", "kill_ingress": "ingress"}  # -> deployment
KILL_CONTROL = {"kill_router": "router", "kill_admission": "admission", "kill_audit": "audit-writer",
                "kill_ledger": "ledger"}  # -> control actor kind (router/actor.py scoped names)
KEYS = {"alice": "chaos-key-alice", "bob": "chaos-key-bob"}
MODEL_NAME = "chaos"


@dataclass
class Outcome:
    kind: str
    request_id: str
    code: str  # "OK" or the gRPC status code's name
    seconds: float
    identical: bool | None = None  # greedy kinds: equal to the reference
    choices: int = 1
    detail: str = ""  # a failure's message (its first line, ids and numbers elided)
    retry_after_s: float = 0.0  # a refusal's retry-after (trailing metadata)


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, target or error)
    leaked: dict = field(default_factory=dict)  # replica -> what it still holds
    audit: dict = field(default_factory=dict)
    client_cpu_s: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict:
        codes = Counter(o.code for o in self.outcomes)
        greedy = [o for o in self.outcomes if o.identical is not None]
        return {"sent": len(self.outcomes), "completed": codes.pop("OK", 0),
                "greedy_identical": sum(o.identical for o in greedy), "greedy_completed": len(greedy),
                "failed": dict(codes.most_common()),
                "failures": dict(Counter(f"{o.code}: {o.detail}" for o in self.outcomes
                                         if o.detail).most_common(8)),
                "by_kind": {k: dict(Counter(o.code for o in self.outcomes if o.kind == k)) for k in KINDS}, "hung": sum(o.code == "HUNG" for o in self.outcomes),
                "faults": dict(Counter(k for _, k, _ in self.faults)), "leaked": self.leaked, "audit": self.audit,
                "client_cpu_s": round(self.client_cpu_s, 1), "wall_s": round(self.wall_s, 1)}


def app_config(model: str, args, audit_dir: str, ledger: str):
    from cluster.config import AppConfig
    from cluster.tools.netutil import free_port

    return AppConfig.model_validate({
        "model": model, "served_model_name": MODEL_NAME, "http_port": free_port(), "grpc_port": free_port(),
        "prefill": {"num_replicas": args.prefill}, "graceful_shutdown_timeout_s": 2.0,
        "decode": {"num_replicas": args.decode, "engine": {"tensor_parallel_size": args.decode_tp}},
        "tenants": {"alice": {"api_keys": [KEYS["alice"]], "monthly_budget_usd": 1e6},
                    "bob": {"api_keys": [KEYS["bob"]], "priority": "batch"}},
        "budgets": {"prices": {MODEL_NAME: {"prompt_per_1k": 0.001, "completion_per_1k": 0.002}},
                    "ledger_path": ledger},
        "audit": {"enabled": True, "dir": audit_dir, "flush_interval_s": 0.2},
        "fault_tolerance": {"fault_injection": True, "replica_wait_s": 30.0},
    })


def prompts(seed: int, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    return {"greedy": [draw(rng.randint(1, 300)) for _ in range(24)],
            "long": [draw(rng.randint(700, 1000)) for _ in range(4)]}


def references(model: str, pool: dict[str, list[list[int]]], max_tokens: int) -> dict[tuple, list[int]]:
    """Greedy tokens of every prompt from the in-process engine on the same checkpoint."""
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_model(model)
    every = pool["greedy"] + pool["long"]
    outs = engine.generate(every, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return {tuple(p): o.token_ids for p, o in zip(every, outs)}


class Traffic:
    """Closed-loop clients: each sends one request of a random kind after another until stopped."""

    def __init__(self, stub, pool, refs, seed: int):
        self.stub, self.pool, self.refs = stub, pool, refs
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.count = 0

    def _next(self) -> tuple[str, str, random.Random]:
        with self.lock:
            self.count += 1
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            return kind, f"chaos-{self.count}", random.Random(self.rng.random())

    def run(self) -> None:
        while not self.stop.is_set():
            kind, rid, rng = self._next()
            outcome = self.one(kind, rid, rng)
            with self.lock:
                self.outcomes.append(outcome)
            if outcome.code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):  # as a client retrying would: waits
                self.stop.wait(min(outcome.retry_after_s or BACKOFF_S, MAX_RETRY_AFTER_S))  # as it was told

    def request(self, kind: str, rid: str, rng: random.Random):
        from protos.pdserve.v1 import generation_pb2 as pb

        if kind in ("greedy", "long", "cancel"):
            prompt = rng.choice(self.pool["long" if kind == "long" else "greedy"])
            return prompt, 1, pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True))
        if kind == "n2":
            return None, 2, pb.GenerateRequest(request_id=rid, n=2, text="Once upon a time", sampling=pb.SamplingParams(
                max_tokens=12, temperature=0.8, seed=rng.randrange(1 << 30)))
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Describe a cat as a JSON object.")])
        return None, 1, pb.GenerateRequest(request_id=rid, chat=chat, sampling=pb.SamplingParams(
            max_tokens=48, temperature=0, response_format=pb.ResponseFormat(type="json_object")))

    def one(self, kind: str, rid: str, rng: random.Random) -> Outcome:
        import grpc

        prompt, n, req = self.request(kind, rid, rng)
        tenant = rng.choice(list(KEYS))
        t0 = time.monotonic()
        tokens: dict[int, list[int]] = {}
        text: dict[int, str] = {}
        finish: dict[int, int] = {}
        call = self.stub.Generate(req, timeout=HUNG_AFTER_S, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),))
        try:
            for resp in call:
                tokens.setdefault(resp.index, []).extend(resp.token_ids)
                text[resp.index] = text.get(resp.index, "") + resp.text
                if resp.finish_reason:
                    finish[resp.index] = resp.finish_reason
                if kind == "cancel":
                    call.cancel()
                    break
        except grpc.RpcError as e:
            code = "HUNG" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
            detail = re.sub(r"[\w.-]*\d[\w.-]*", "#", (e.details() or "").split("\n")[0])[:160]
            retry = dict(e.trailing_metadata() or ()).get("retry-after")
            return Outcome(kind, rid, code, time.monotonic() - t0, detail=detail,
                           retry_after_s=float(retry) if retry else 0.0)
        seconds = time.monotonic() - t0
        if kind == "cancel":
            return Outcome(kind, rid, "CANCELLED_BY_CLIENT", seconds)
        if len(finish) != n:
            return Outcome(kind, rid, "UNFINISHED", seconds)
        outcome = Outcome(kind, rid, "OK", seconds, choices=n)
        if prompt is not None:
            outcome.identical = tokens.get(0) == self.refs[tuple(prompt)]
        if kind == "json" and finish[0] == 1:  # STOP: the object is complete
            try:
                json.loads(text[0])
            except ValueError:
                outcome.code = "BAD_JSON"
        return outcome


class Chaos:
    """The fault schedule: one seeded fault every `every_s` seconds, logged with its target."""

    def __init__(self, seed: int, every_s: float, tp: int, report: Report, t0: float):
        self.rng = random.Random(seed + 1)
        self.every_s, self.report, self.t0 = every_s, report, t0
        self.faults = {k: w for k, w in FAULTS.items() if k != "kill_tp_rank" or tp > 1}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            kind = self.rng.choices(list(self.faults), weights=list(self.faults.values()))[0]
            try:
                target = self.make(kind)
            except Exception as e:  # noqa: BLE001 — a fault that could not be made is logged, not fatal
                target = f"not made: {e!r}"
            self.report.faults.append((round(time.monotonic() - self.t0, 1), kind, target))
            print(f"  t={time.monotonic() - self.t0:6.1f}s  {kind}: {target}", flush=True)

    def make(self, kind: str) -> str:
        """Make one fault; returns its target."""
        if kind in KILL_SERVE:
            return self._kill_serve(KILL_SERVE[kind])
        if kind in KILL_CONTROL:
            return self._kill_control(KILL_CONTROL[kind])
        return getattr(self, kind)()

    def _replica(self, deployment: str) -> str:
        import ray

        prefix = f"SERVE_REPLICA::pdserve#{deployment}#"
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
        if not names:
            raise LookupError(f"no live {deployment} replica")
        return self.rng.choice(names)

    def _kill_serve(self, deployment: str) -> str:
        import ray

        name = self._replica(deployment)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name.rsplit("#", 1)[1]

    def _kill_control(self, kind: str) -> str:
        import ray

        from router.actor import DEFAULT_APP, app_actor_names, lookup, scoped_name

        name = scoped_name(DEFAULT_APP, kind)  # app/kind, or app/kind/... (a router per model version)
        names = [n for n in app_actor_names(DEFAULT_APP) if n == name or n.startswith(name + "/")]
        if not names:
            raise LookupError(f"no {kind} actor")
        name = self.rng.choice(names)
        ray.kill(lookup(name), no_restart=False)  # Ray restarts it (max_restarts=-1)
        return name

    def drop_pulls(self) -> str:
        from ray import serve

        rid = self._replica("decode").rsplit("#", 1)[1]
        handle = serve.get_deployment_handle("decode", "pdserve")
        handle.inject_fault.remote(pull="drop", target_replica=rid).result(timeout_s=30)
        self.stop.wait(3.0)
        handle.inject_fault.remote(pull="none", target_replica=rid).result(timeout_s=30)
        return rid

    def kill_tp_rank(self) -> str:
        """A decode replica's tensor-parallel worker rank (a Ray actor, `pdserve-tp:<replica>:<rank>`)."""
        import ray

        rid = self._replica("decode").rsplit("#", 1)[1]
        ranks = sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(f"pdserve-tp:{rid}:"))
        if not ranks:
            raise LookupError(f"decode replica {rid} has no worker rank")
        name, namespace = self.rng.choice(ranks)
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        return name


def settle(lease_s: float) -> dict:
    """Every live engine replica, once the load stopped: waits up to lease_s + 30 s for each to hold
    no block, lease or request; returns what those that never got there still hold."""
    import ray
    from ray import serve

    deadline = time.monotonic() + lease_s + 30.0
    while True:
        held = {}
        for deployment in ("prefill", "decode"):
            prefix = f"SERVE_REPLICA::pdserve#{deployment}#"
            handle = serve.get_deployment_handle(deployment, "pdserve")
            for a in ray.util.list_named_actors(all_namespaces=True):
                if a["name"].startswith(prefix):
                    rid = a["name"].rsplit("#", 1)[1]
                    s = handle.load.remote(target_replica=rid).result(timeout_s=60)
                    busy = {k: s[k] for k in ("running", "waiting", "importing", "held") if s[k]}
                    if s["replica_id"] == rid and (s["free_blocks"] != s["total_blocks"] or busy):
                        held[f"{deployment}/{rid}"] = {"blocks": s["total_blocks"] - s["free_blocks"], **busy}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(1.0)  # polling replicas' loads: nothing to wait on


def audit_check(audit_dir: str, outcomes: list[Outcome]) -> dict:
    """Records per client request id against what the clients saw: one per choice of each request
    that completed (missing: fewer; duplicated: a request id written twice); the chain verified."""
    from router.ingress.gateway.audit_log import read_records, verify

    result = verify(audit_dir)
    per_client: Counter = Counter()
    per_request: Counter = Counter()
    for rec in read_records(audit_dir):
        per_client[rec.get("client_request_id")] += 1
        per_request[rec["request_id"]] += 1
    completed = [o for o in outcomes if o.code == "OK"]
    return {"chain_ok": result.ok, "chain_error": result.error, "records": result.records,
            "missing": sum(max(0, o.choices - per_client[o.request_id]) for o in completed),
            "duplicated": sum(c - 1 for c in per_request.values() if c > 1),
            "failed_with_record": sum(per_client[o.request_id] > 0 for o in outcomes if o.code != "OK")}


def soak(args, model: str, report: Report) -> None:
    import grpc
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    pool = prompts(args.seed, vocab=args.vocab)
    t = time.monotonic()
    refs = references(model, pool, max_tokens=16)
    print(f"references in {time.monotonic() - t:.0f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    cfg = app_config(model, args, str(work / "audit"), str(work / "ledger.json"))
    started = time.monotonic()
    ray.init(num_cpus=serve_app.cpus_needed(cfg) + 4, include_dashboard=False, log_to_driver=False)
    try:
        serve_app.start(cfg)
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        print(f"app up in {time.monotonic() - started:.0f} s; soaking {args.minutes:g} min", flush=True)
        traffic = Traffic(pb_grpc.GenerationStub(channel), pool, refs, args.seed)
        t0, cpu0 = time.monotonic(), time.process_time()
        chaos = Chaos(args.seed, args.fault_every, args.decode_tp, report, t0)
        threads = [threading.Thread(target=traffic.run) for _ in range(args.clients)]
        threads.append(threading.Thread(target=chaos.run))
        for t in threads:
            t.start()
        traffic.stop.wait(args.minutes * 60)
        traffic.stop.set()
        chaos.stop.set()
        for t in threads:
            t.join()
        report.wall_s, report.client_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
        report.outcomes = traffic.outcomes
        t1 = time.monotonic()
        report.leaked = settle(cfg.kv_transfer.lease_s)
        print(f"settled in {time.monotonic() - t1:.0f} s", flush=True)
        channel.close()
        t1 = time.monotonic()
        serve.delete("pdserve")  # the ingresses drain: their spooled audit records reach the writer
        print(f"app deleted in {time.monotonic() - t1:.0f} s", flush=True)
        report.audit = audit_check(str(work / "audit"), report.outcomes)
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv=None) -> int:
    from cluster.app.builder import ensure_model
    from cluster.config import AppConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    model = ensure_model(AppConfig(), default=args.model).model
    args.vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    report = Report()
    soak(args, model, report)
    s = report.summary()
    print(json.dumps(s, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({**s, "fault_log": report.faults}, indent=2))
    bad = s["hung"] or s["leaked"] or s["audit"]["missing"] or s["audit"]["duplicated"] or not s["audit"]["chain_ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
