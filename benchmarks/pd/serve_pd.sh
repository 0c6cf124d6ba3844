#!/usr/bin/env bash
# 1 prefill + 1 decode (behind `wideserve router`) against one colocated server, same model
# (the bundled V4), on a prefill-heavy random workload and on the agentic workload.
# Points alternate between the two deployments so machine noise hits both alike.
#   benchmarks/pd/serve_pd.sh [OUT_DIR]      (default benchmarks/results/pd_serve)
#   WORKLOADS="random agentic" (default both) picks the workloads.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/pd_serve}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 UCX_NET_DEVICES=lo UCX_MODULES=^ib
export WIDESERVE_KV_SECRET=${WIDESERVE_KV_SECRET:-bench-secret-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
PY=${PYTHON:-python}
COMMON=(--max-num-seqs 32 --log-level warning)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
$PY -m wideserve.entrypoints.cli serve "${COMMON[@]}" --port 8311 \
  --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}' & pids+=($!)
$PY -m wideserve.entrypoints.cli serve "${COMMON[@]}" --port 8312 \
  --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}' & pids+=($!)
$PY -m wideserve.entrypoints.cli serve "${COMMON[@]}" --port 8313 & pids+=($!)
$PY -m wideserve.entrypoints.cli router --prefill http://127.0.0.1:8311 \
  --decode http://127.0.0.1:8312 --port 8310 --log-level warning & pids+=($!)
for port in 8310 8311 8312 8313; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
bench() {  # name url args...
  local name=$1 url=$2; shift 2
  $PY -m wideserve.entrypoints.cli bench serve --base-url "$url" --no-progress \
    --output-json "$OUT/$name.json" "$@"
}
WORKLOADS=${WORKLOADS:-random agentic}
[[ $WORKLOADS == *random* ]] && for round in 1 2; do
  for dep in pd:8310 colocated:8313; do
    name=${dep%%:*}; url=http://127.0.0.1:${dep##*:}
    bench "prefill_heavy_${name}_r$round" "$url" --dataset random --input-len 700 \
      --output-len 16 --num-prompts 32 --max-concurrency 4
  done
done
# agentic: the scaled AgentX sessions of BENCHMARKS.md "Serving curves" (bundled model,
# 1024 context)
[[ $WORKLOADS == *agentic* ]] && for dep in pd:8310 colocated:8313; do
  name=${dep%%:*}; url=http://127.0.0.1:${dep##*:}
  bench "agentic_${name}" "$url" --dataset agentic --agentic-preset 256k \
    --agentic-sessions 32 --agentic-min-osl 2 --agentic-scale 0.003 --time-scale 0.02 \
    --duration 40 --warmup-per-lane 2 --max-concurrency 2
done
curl -s http://127.0.0.1:8310/metrics | grep -E "^wideserve_router_(remote_kv|requests)_total" > "$OUT/router_metrics.txt"
curl -s http://127.0.0.1:8312/metrics > "$OUT/decode_metrics.txt" || true
