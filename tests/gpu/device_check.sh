#!/usr/bin/env bash
# Issue 22's GPU checks in one call of a lent GPU machine (CUDA torch there, no network, no Ray):
# tests/gpu, TTFT/TPOT against transformers' generate (dynamic steps, then CUDA graphs) with profiles, NIXL in VRAM.
#   bash tests/gpu/device_check.sh OUTDIR [tests] [latency] [host] [nixl]     (default: tests latency nixl)
# Run from the repo root with the wheels in .whl/ (docs/benchmarks.md, "The GPU path", says which), or
# WHEELS=.whl_app (tests/gpu/app_wheels.py's set, which holds them too).
# LATENCY_MODELS (default llama-1b), LATENCY_ARGS, LATENCY_STATIC, LATENCY_HF= (no hf arm) narrow the latency
# part, HOST_STATIC the host part, NIXL_ARGS the NIXL part, TESTS_K the tests (pytest -k), WHEELS the wheels. Each part has its own time limit, so
# one that hangs leaves the others their time. At most 7 files in OUTDIR.
set -u
OUT=${1:?usage: device_check.sh OUTDIR [tests] [latency] [nixl]}
shift
PARTS=${*:-tests latency nixl}
mkdir -p "$OUT"
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
quiet() { grep -v -E "NIXL INFO|Loading weights|UserWarning|warnings.warn|_warn_once|^\s*$"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 -c "import torch, transformers, triton; print('triton', triton.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
    PDSERVE_GPU_REPORT=$OUT/accuracy.jsonl timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/gpu -q -p no:cacheprovider \
      -rA --timeout 100 ${TESTS_K:+-k "$TESTS_K"}
    echo "pytest exit $?"
  } > "$OUT/pytest.txt" 2>&1
  tail -4 "$OUT/pytest.txt"
fi
if has latency; then
  # each model: every step built dynamically, then decode steps replayed as CUDA graphs, then hf
  for m in ${LATENCY_MODELS:-llama-1b}; do
    timeout ${LATENCY_TIMEOUT:-240} python3 -m cluster.tools.bench.ttft_tpot --model "$m" ${LATENCY_HF---hf} --reps 2 \
      --static-decode ${LATENCY_STATIC:-off graphs} ${LATENCY_ASYNC:+--async-output $LATENCY_ASYNC} --profile "$OUT/profile-$m" ${LATENCY_ARGS:-} 2>&1 | quiet > "$OUT/latency-$m.txt"
    echo "latency $m exit ${PIPESTATUS[0]}"; tail -16 "$OUT/latency-$m.txt"; head -1 "$OUT"/profile-$m.*
  done
fi
if has host; then  # the host's share of a decode step: every step built dynamically vs replayed graphs
  timeout ${HOST_TIMEOUT:-90} python3 -m cluster.tools.bench.host_overhead --device cuda --static-decode ${HOST_STATIC:-off graphs} \
    --streams 1 32 128 256 > "$OUT/host.txt" 2>&1
  echo "host exit $?"; grep -E "^static|^ +[0-9]+ " "$OUT/host.txt"
fi
if has nixl; then
  UCX_PROTO_INFO=y timeout 90 python3 -m cluster.tools.bench.kv_transfer --device cuda --model smollm2-shape \
    --dtype bfloat16 ${NIXL_ARGS:---lengths 16 128 512 1024 2000 --bulk-mib 1 4 16 64 256 1024 --reps 5} > "$OUT/nixl.txt" 2>&1
  echo "nixl exit $?"
  # the protocol UCX chose for the pull (a READ into GPU memory from GPU memory)
  grep -A6 "remote memory read by ucp_get.* into cuda" "$OUT/nixl.txt" | grep -E "\| [0-9]" | sed -E "s/^\[[^]]*\] +\[[^]]*\] +//" | sort | uniq -c | head -4
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ |^bulk|^UCX transports|Error|error" "$OUT/nixl.txt" | head -20
fi
