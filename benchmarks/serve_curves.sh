#!/usr/bin/env bash
# Serving curves (BENCHMARKS.md, "Serving curves"): a concurrency sweep of `wideserve bench
# serve` against `wideserve serve`, for the random and agentic workloads, on the bundled
# shakespeare-v4-tiny and on a dummy-weight Qwen3-MoE (benchmarks/configs/qwen3-moe-small).
# Every server runs fp32 on one thread with 64-token KV blocks (the agentic traces' hash-block
# size). Results: benchmarks/results/serve_*.json; plots: benchmarks/plot_curves.py.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
PORT=${PORT:-8765}
URL=http://127.0.0.1:$PORT
TOK=wideserve/assets/shakespeare-v4-tiny

start_server() {          # args: extra serve flags
  .venv/bin/wideserve serve "$@" --dtype float32 --block-size 64 --port "$PORT" \
    --log-level warning > "$OUT/.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf "$URL/health" > /dev/null && return 0
    sleep 0.5
  done
  echo "server did not start"; cat "$OUT/.server.log"; exit 1
}
stop_server() { kill -INT "$SERVER"; wait "$SERVER" || true; rm -f "$OUT/.server.log"; }

bench() {                 # args: name, then bench serve flags
  local name=$1; shift
  echo "== $name ($(uptime | sed 's/.*load/load/'))"
  .venv/bin/wideserve bench serve --base-url "$URL" --tokenizer "$TOK" --save-samples \
    --no-progress --output-json "$OUT/serve_$name.json" "$@"
}

RANDOM_FLAGS="--dataset random --input-len 256 --output-len 64 --range-ratio 0.2 --prompts-per-concurrency 4"
AGENTIC_FLAGS="--dataset agentic --agentic-preset 256k --agentic-sessions 32 --agentic-min-osl 2 --time-scale 0.02 --duration 40 --warmup-per-lane 2"

start_server
bench v4tiny_random $RANDOM_FLAGS --max-concurrency 1 2 4 8 16
bench v4tiny_agentic $AGENTIC_FLAGS --agentic-scale 0.003 --max-concurrency 1 2 4 8
stop_server

start_server benchmarks/configs/qwen3-moe-small --load-format dummy --tokenizer "$TOK"
bench qwen3moe_random $RANDOM_FLAGS --max-concurrency 1 2 4 8 16
bench qwen3moe_agentic $AGENTIC_FLAGS --agentic-scale 0.012 --max-concurrency 1 2 4 8
stop_server
.venv/bin/python benchmarks/plot_curves.py
