#!/usr/bin/env bash
# Issue 40's last GPU line: the whole app under Ray Serve on one GPU, with its figures. One call of a
# lent GPU machine (python3 with CUDA torch, no network, no Ray): `pdserve up` with one prefill and
# one decode replica sharing the GPU (num_gpus 0.5 each), KV over NIXL (cuda_ipc), then `pdserve bench`
# at a few concurrencies, a check that the requests took the disaggregated path, and a clean stop.
#   bash tests/gpu/app_check.sh OUTDIR
# Run from the repo root with the wheels of tests/gpu/app_wheels.py in .whl_app/. Every step has its
# own time limit and the whole script ends within ~270 s even when one hangs. At most 7 files in OUTDIR.
# APP_CHECK_DEVICE=cpu rehearses it on a CPU machine: a small float32 model, no GPU, lower concurrency.
# Other knobs (environment): PYTHON, APP_CHECK_WHEELS, APP_CHECK_SITE, APP_CHECK_CONCURRENCY,
# APP_CHECK_SECONDS (per concurrency), APP_CHECK_READY_S (start-up wait), APP_CHECK_HTTP_PORT, APP_CHECK_GRPC_PORT.
set -u
OUT=$(mkdir -p "${1:?usage: app_check.sh OUTDIR}" && cd "$1" && pwd)
DEVICE=${APP_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
SITE=${APP_CHECK_SITE:-/tmp/site}
WHEELS=${APP_CHECK_WHEELS:-.whl_app}
HTTP=${APP_CHECK_HTTP_PORT:-18000}
GRPC=${APP_CHECK_GRPC_PORT:-19000}
WORK=$(mktemp -d /tmp/appchk.XXXX)  # short: Ray's socket paths live under it
RAYLOGS=$WORK/ray/ray/session_latest/logs  # RAY_TMPDIR=$WORK/ray below
LOG=$OUT/app.txt
T0=$SECONDS
if [ "$DEVICE" = cuda ]; then
  DTYPE=bfloat16 NUM_GPUS=0.5 KV_GB=4 BATCHED=8192 REQUIRED="[cuda_ipc]"
  CONCURRENCY=${APP_CHECK_CONCURRENCY:-1 16 64} SECONDS_EACH=${APP_CHECK_SECONDS:-20}
  # SmolLM2-135M's shape (cluster/tools/bench/ttft_tpot.py), random bf16 weights
  MODEL_ARGS="--layers 30 --hidden 576 --heads 9 --kv-heads 3 --intermediate 1536 --vocab 49152 --tie-embeddings"
else
  DTYPE=float32 NUM_GPUS=0 KV_GB=0.25 BATCHED=512 REQUIRED="[]"
  CONCURRENCY=${APP_CHECK_CONCURRENCY:-1 4 16} SECONDS_EACH=${APP_CHECK_SECONDS:-20}
  MODEL_ARGS="--layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 320"
fi

say() { echo "[app_check +$((SECONDS - T0))s] $*" | tee -a "$LOG"; }
left() { echo $((262 - (SECONDS - T0))); }  # seconds left of the script's budget (cleanup included)
cap() { local want=$1 l; l=$(( $(left) - 30 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }

serve_logs() {  # the tail of each Serve log (controller, proxy, replicas) and of Ray's own errors
  for f in "$RAYLOGS"/serve/*.log "$RAYLOGS"/raylet.err "$RAYLOGS"/gcs_server.err; do
    [ -s "$f" ] && { echo "==> ${f#"$RAYLOGS"/} <=="; tail -n "$1" "$f"; }
  done > "$OUT/serve.log" 2>&1
}

UP_PID=
cleanup() {
  trap - EXIT INT TERM
  if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
    say "stopping pdserve (SIGTERM: serve.shutdown, ray.shutdown)"
    kill -TERM "$UP_PID"
    for _ in $(seq 40); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$UP_PID" 2>/dev/null && { say "pdserve did not stop in 20 s: killing its process group"; kill -KILL -- "-$UP_PID"; }
  fi
  # what Ray started under our temp dir (raylet, gcs_server, agents), by process id
  for f in /proc/[0-9]*/cmdline; do
    grep -qsF "$WORK/" "$f" && kill -KILL "$(basename "$(dirname "$f")")" 2>/dev/null
  done
  [ "$DEVICE" = cuda ] && timeout 15 "$PY" -c "from ray.scripts.scripts import main; main()" stop --force >/dev/null 2>&1
  tail -n 400 "$WORK/up.log" > "$OUT/up.log" 2>/dev/null
  say "done in $((SECONDS - T0)) s"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

: > "$LOG"
say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$WHEELS"/*.whl >> "$LOG" 2>&1 || { say "FAIL: wheel install"; exit 1; }
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_TMPDIR=$WORK/ray \
  RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
PDSERVE="$PY -m cluster.app.cli"
timeout 60 "$PY" - >> "$LOG" 2>&1 <<'EOF' || { say "FAIL: imports"; exit 1; }
import importlib.metadata as md, os, torch
names = ["ray", "nixl-cu13", "pydantic", "fastapi", "starlette", "uvicorn", "grpcio", "protobuf", "aiohttp",
         "transformers", "numpy", "llguidance"]
print("python", os.sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", "cpus", os.cpu_count())
print(", ".join(f"{n} {md.version(n)}" for n in names))
import ray, ray.serve, nixl, fastapi, cluster.app.builder  # the app's imports, before Ray starts
from kv_transfer.transports import available_transports
print("UCX transports here:", available_transports())
EOF
say "$(tail -3 "$LOG" | tr '\n' ' ')"

say "writing a random $DTYPE checkpoint ($MODEL_ARGS)"
# shellcheck disable=SC2086
timeout 60 $PDSERVE init-model "$WORK/model" $MODEL_ARGS --max-positions 2048 --dtype "$DTYPE" >> "$LOG" 2>&1 \
  || { say "FAIL: init-model"; exit 1; }
cat > "$WORK/app.yaml" <<EOF
mode: disaggregated
model: $WORK/model
served_model_name: app-check
host: 127.0.0.1
http_port: $HTTP
grpc_port: $GRPC
engine: {device: $DEVICE, dtype: $DTYPE, kv_cache_memory_gb: $KV_GB, max_num_seqs: 64, max_num_batched_tokens: $BATCHED}
prefill: {num_replicas: 1, num_cpus: 1, num_gpus: $NUM_GPUS}
decode: {num_replicas: 1, num_cpus: 1, num_gpus: $NUM_GPUS}
kv_transfer: {required_transports: $REQUIRED}
admission: {max_queue_wait_s: none, target_itl_s: none}   # measure the serving path, not its refusals
routing: {local_prefill_threshold: 0}                       # every prompt is prefilled remotely
EOF
cat "$WORK/app.yaml" >> "$LOG"

say "pdserve up (one prefill + one decode replica, num_gpus $NUM_GPUS each)"
setsid $PDSERVE up --config "$WORK/app.yaml" --no-dashboard > "$WORK/up.log" 2>&1 &
UP_PID=$!
ready=0
for _ in $(seq $(( $(cap "${APP_CHECK_READY_S:-120}") * 2 ))); do
  grep -q "^pdserve is serving" "$WORK/up.log" && { ready=1; break; }
  kill -0 "$UP_PID" 2>/dev/null || break
  sleep 0.5
done
if [ $ready = 0 ]; then
  say "FAIL: not ready (pdserve up $(kill -0 "$UP_PID" 2>/dev/null && echo still starting || echo exited))"
  tail -n 40 "$WORK/up.log" | tee -a "$LOG"
  timeout 20 "$PY" -c "import ray; ray.init(address='auto', log_to_driver=False); print('Ray resources:', \
    ray.cluster_resources(), 'free:', ray.available_resources())" 2>&1 | tail -2 | tee -a "$LOG"
  serve_logs 80
  exit 1
fi
say "ready"
timeout 60 $PDSERVE generate --address "127.0.0.1:$GRPC" --prompt-token-ids 1,2,3,4,5,6,7,8 --max-tokens 8 \
  --ignore-eos --json >> "$LOG" 2>&1 && say "first request: ok" || say "FAIL: first request"

rm -f "$WORK"/bench-*.json
for c in $CONCURRENCY; do
  secs=$(cap "$SECONDS_EACH")
  [ "$secs" -lt 5 ] && { say "skipping concurrency $c: out of time"; continue; }
  say "bench: $c streams, ~$secs s (512-token prompts, 128 output tokens, ignore_eos)"
  SAMPLER=
  if [ "$c" = "${CONCURRENCY##* }" ] && [ "$DEVICE" = cuda ]; then  # the GPU's processes under the heaviest load
    ( sleep $(( secs / 2 + 3 )); timeout 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv \
      > "$WORK/apps.csv" 2>&1 ) &
    SAMPLER=$!
  fi
  timeout $(( secs + 25 )) $PDSERVE bench --backend grpc --address "127.0.0.1:$GRPC" --dataset-name random \
    --random-input-len 512 --random-output-len 128 --ignore-eos --max-concurrency "$c" \
    --num-prompts $(( c * 60 + 16 )) --warmup-requests "$c" --duration-s "$secs" --seed "$c" --disable-tqdm \
    --label "c$c" --result-file "$WORK/bench-c$c.json" >> "$LOG" 2>&1 || say "bench at $c streams: exit $?"
  [ -n "$SAMPLER" ] && wait "$SAMPLER"
done

# the figures: one row per concurrency (bench.tsv) and the aggregates without per-request arrays (bench.json)
"$PY" - "$WORK" "$OUT" $CONCURRENCY <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
work, out, cs = sys.argv[1], sys.argv[2], sys.argv[3:]
rows, agg = [], {}
cols = ["streams", "completed", "failed", "incomplete", "duration_s", "req_per_s", "out_tok_per_s",
        "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "itl_p50_ms", "itl_p90_ms"]
for c in cs:
    try:
        r = json.load(open(f"{work}/bench-c{c}.json"))
    except (OSError, ValueError):
        continue
    agg[c] = {k: v for k, v in r.items() if not isinstance(v, list)}
    g = lambda k: r.get(k) if r.get(k) is not None else float("nan")
    rows.append([c, r.get("completed"), r.get("failed"), r.get("incomplete"), g("duration"), g("request_throughput"),
                 g("output_throughput"), g("median_ttft_ms"), g("p90_ttft_ms"), g("median_tpot_ms"),
                 g("p90_tpot_ms"), g("median_itl_ms"), g("p90_itl_ms")])
fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)
text = "\t".join(cols) + "\n" + "".join("\t".join(fmt(v) for v in row) + "\n" for row in rows)
open(f"{out}/bench.tsv", "w").write(text)
json.dump(agg, open(f"{out}/bench.json", "w"), indent=1, default=str)
print(text, end="")
EOF

# the disaggregated path: prefill granted leases, decode pulled their blocks over NIXL, nothing recomputed
timeout "$(cap 30)" $PDSERVE status --json > "$OUT/status.json" 2>> "$LOG"
"$PY" - "$OUT/status.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"FAIL: no status ({e})")
pools = {}
for rid, r in s["replicas"].items():
    t = r["transfer"]
    pools.setdefault(r["pool"], []).append(rid)
    print(f"{r['pool']:<8} {rid}: steps {r['steps']}, generated {r['generation_tokens']}, leases granted "
          f"{t['leases_granted']} released {t['leases_released']} expired {t['leases_expired']}; pulls ok "
          f"{t['pulls_ok']} failed {t['pulls_failed']} timed out {t['pulls_timed_out']}, recomputed "
          f"{t['fallbacks_recompute']}, {t['blocks_pulled']} blocks / {t['bytes_pulled'] / 2**20:.1f} MiB pulled "
          f"in {t['pull_seconds_sum'] * 1e3:.0f} ms (max {t['pull_seconds_max'] * 1e3:.1f} ms)")
rs = s["replicas"].values()
pulls = sum(r["transfer"]["pulls_ok"] for r in rs if r["pool"] == "decode")
leases = sum(r["transfer"]["leases_granted"] for r in rs if r["pool"] == "prefill")
bad = sum(r["transfer"]["pulls_failed"] + r["transfer"]["fallbacks_recompute"] for r in rs)
ok = pulls > 0 and leases > 0 and bad == 0 and len(pools.get("prefill", [])) == 1 and len(pools.get("decode", [])) == 1
print(("PASS" if ok else "FAIL") + f": disaggregated path: {leases} leases granted by prefill, {pulls} NIXL pulls by"
      f" decode, {bad} failed or recomputed")
EOF

if [ "$DEVICE" = cuda ]; then
  {
    timeout 20 nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
    echo "# compute processes during the last bench run, with their command lines (Ray titles each replica)"
    cat "$WORK/apps.csv" 2>/dev/null
    for p in $(tail -n +2 "$WORK/apps.csv" 2>/dev/null | cut -d, -f1); do echo "pid $p: $(tr '\0' ' ' < "/proc/$p/cmdline")"; done
  } > "$OUT/gpu.txt" 2>&1
  n=$(grep -c -E "^pid [0-9]+: .*ServeReplica:pdserve:(prefill|decode)" "$OUT/gpu.txt")
  [ "$n" -eq 2 ] && say "PASS: the prefill and the decode replica both run on the GPU" \
    || say "FAIL: $n replica processes on the GPU, 2 expected ($(tail -n +2 "$WORK/apps.csv" 2>/dev/null | wc -l) compute processes: gpu.txt)"
fi
serve_logs 30
