#!/bin/bash
# Alternate benchmarks/v4_decode_context.py between two source trees (BENCHMARKS.md, "DeepSeek-V4:
# decode step time at 2K vs 32K context"): BEFORE (a tree holding an older wideserve/, e.g.
# `git archive <commit> wideserve | tar -x -C /tmp/before`) and this checkout, the latter also
# with the CSA indexer on its torch loop instead of the fused CPU op. Run it
# on a quiet machine (build the C++ extension first: python -m wideserve.kernels.loader).
#   benchmarks/v4_decode_context_ab.sh /tmp/before <before-tag> [rounds] [python]
set -e
BEFORE=$1; TAG=$2; ROUNDS=${3:-3}; PY=${4:-.venv/bin/python}
cd "$(dirname "$0")/.."
OUT=benchmarks/results/v4_decode_context.jsonl
run() { PYTHONPATH=$1 OMP_NUM_THREADS=1 $PY benchmarks/v4_decode_context.py --steps 15 --out $OUT "${@:2}"; }
uptime
for _ in $(seq "$ROUNDS"); do
  run "$BEFORE" --tag "$TAG"
  run "$PWD" --tag after
  run "$PWD" --tag "after, torch indexer" --indexer torch
  uptime
done
