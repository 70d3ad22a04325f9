#!/bin/bash
# Time from `make run` on a fresh clone of this checkout (no venv, no pip cache, no model cache)
# to the first chat answer that names Paris. Uses ports 8000/9000/8265; stops the server after.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
rm -rf /tmp/fresh /tmp/freshhome && git clone -q "$REPO" /tmp/fresh && cd /tmp/fresh
export PYENV_ROOT="${PYENV_ROOT:-$HOME/.pyenv}" HOME=/tmp/freshhome PIP_NO_CACHE_DIR=1
mkdir -p $HOME
start=$(date +%s.%N)
setsid make run > /tmp/fresh_run.log 2>&1 &
pid=$!
marks=""
while true; do
  if [ -z "$marks" ] && [ -f .venv/.installed ]; then marks="venv ready after $(echo "$(date +%s.%N) - $start" | bc) s"; echo "$marks"; fi
  out=$(curl -s -m 60 localhost:8000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":30,"temperature":0}' 2>/dev/null)
  if echo "$out" | grep -q Paris; then break; fi
  if ! kill -0 $pid 2>/dev/null; then echo "make run exited"; tail -30 /tmp/fresh_run.log; exit 1; fi
  sleep 1
done
end=$(date +%s.%N)
echo "first answer after $(echo "$end - $start" | bc) s: $out"
grep -n "serving\|Ctrl-C" /tmp/fresh_run.log | head -5
kill -INT -- -$pid; sleep 15; kill -9 -- -$pid 2>/dev/null
