"""Re-simulate the saved medians' 13 cases (issue 42 session 18) and print the MAPE + a digest of sim figures."""
import hashlib, json, sys
from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.profile import Profile
from cluster.planner.simulator import simulate
from cluster.planner.validation import Case, Metrics, Validation
from cluster.planner.workload import read_trace
D = "docs/bench-plan-validation/"
prof = Profile.load(D + "profile-sharing.json")
v = Validation.load(D + "validation-medians.json")
base = ClusterConfig(0, 1, 512, 64, int(1 * 2**30 // prof.engine["kv_block_bytes"]), 64, 2.0)
cases, h = [], hashlib.sha256()
for c in v.cases:
    text = c.config.split(" ")[0]
    chunk = int(c.config.split("chunk=")[1].split(" ")[0])
    cfg = ClusterConfig.parse(f"{text}:chunk={chunk}", base)
    specs = read_trace(D + f"{c.workload}-trace.jsonl")
    sim = Metrics.of_sim(simulate(prof, cfg, specs, c.slo))
    h.update(repr(sim).encode())
    cases.append(Case(c.config, c.workload, c.slo, c.real, sim, c.completed, c.requests, c.client, c.cpu, c.runs))
nv = Validation(tuple(cases), v.workloads, v.profile, v.created)
print({k: round(x, 2) for k, x in nv.mape().items()}, "saved:", {k: round(x, 2) for k, x in v.mape().items()})
print("sim digest", h.hexdigest()[:16])
