#!/usr/bin/env bash
# Alternate the captured decode step off/on, REPEATS rounds, one process per run.
#   benchmarks/history/decode_capture_ab.sh MODEL OUT.jsonl [REPEATS] [NUM_PROMPTS]
set -euo pipefail
model=$1; out=$2; repeats=${3:-3}; n=${4:-64}
py=${WS_PY:-python}
export OMP_NUM_THREADS=1
for r in $(seq "$repeats"); do
  for c in 0 1; do
    "$py" "$(dirname "$0")/decode_capture_ab.py" "$model" "$c" --num-prompts "$n" | tee -a "$out"
  done
done
