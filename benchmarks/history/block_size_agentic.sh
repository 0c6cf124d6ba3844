#!/usr/bin/env bash
# The default KV block size (the prefix-hash unit) by measurement (BENCHMARKS.md, "KV block
# size on the agentic workload"): the agentic replay of "Serving curves" at 4 concurrent
# session trees against `wideserve serve --block-size B`, for each legal B of each model
# (DeepSeek-V4's compression ratios 4 and 128 make 128 its smallest block; GQA models take
# any). Reports the server's prefix-cache hit rate and mean engine step (from /metrics), TTFT,
# TPOT and total tokens/s. Results: benchmarks/results/block_size_<model>_<B>.json.
#   benchmarks/history/block_size_agentic.sh [duration_s]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=benchmarks/results
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
PY=${PY:-/work/main/.venv/bin/python}
PORT=${PORT:-8767}
URL=http://127.0.0.1:$PORT
TOK=wideserve/assets/shakespeare-v4-tiny
DURATION=${1:-30}

start_server() {          # args: block size, then extra serve flags
  local bs=$1; shift
  "$PY" -m wideserve.entrypoints.cli serve "$@" --dtype float32 --block-size "$bs" \
    --port "$PORT" --log-level warning > "$OUT/.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf "$URL/health" > /dev/null && return 0
    sleep 0.5
  done
  echo "server did not start"; cat "$OUT/.server.log"; exit 1
}
stop_server() { kill -INT "$SERVER"; wait "$SERVER" || true; rm -f "$OUT/.server.log"; }

bench() {                 # args: name, agentic scale
  echo "== $1 ($(uptime | sed 's/.*load/load/'))"
  "$PY" -m wideserve.entrypoints.cli bench serve --base-url "$URL" --tokenizer "$TOK" \
    --no-progress --output-json "$OUT/block_size_$1.json" --dataset agentic \
    --agentic-preset 256k --agentic-sessions 32 --agentic-min-osl 2 --time-scale 0.02 \
    --duration "$DURATION" --warmup-per-lane 2 --agentic-scale "$2" --max-concurrency 4 \
    > /dev/null
  "$PY" - "$OUT/block_size_$1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
p = (d.get("points") or d.get("results") or [d])[0]
m, s = p.get("metrics", p), p.get("server") or p.get("metrics", p).get("server") or {}
f = lambda v, k=1e3: None if v is None else round(v * k, 2)
print(json.dumps({"file": sys.argv[1], "requests": m["completed"],
                  "hit_rate": s.get("prefix_cache_hit_rate"), "mean_step_ms": f(s.get("mean_step_s")),
                  "ttft_p50_ms": f(m["ttft_s"]["p50"]), "tpot_p50_ms": f(m["tpot_s"]["p50"]),
                  "total_tok_s": round(m["total_token_throughput"], 1)}))
PY
}

for bs in 64 128 256; do
  start_server "$bs" benchmarks/configs/qwen3-moe-small --load-format dummy --tokenizer "$TOK"
  bench "qwen3moe_$bs" 0.012
  stop_server
done
for bs in 128 256; do
  start_server "$bs"
  bench "v4tiny_$bs" 0.003
  stop_server
done
