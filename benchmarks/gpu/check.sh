#!/usr/bin/env bash
# The prepared GPU check (docs/testing.md): <= 8 minutes on one H200, idempotent (writes
# only under $OUT or benchmarks/gpu/results/), installs nothing. NOT YET RUN ON A GPU.
#   1. the tests marked `gpu` (skipped, with their reason, where no CUDA device is);
#   2. benchmarks/gpu/check.py: greedy V4 / V4.1 / Qwen3-MoE on cuda vs CPU fp32, captured
#      decode vs eager, host syncs per step, decode step time at batch 1/8/64.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
OUT_DIR="${OUT:-benchmarks/gpu/results}"
mkdir -p "$OUT_DIR"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
timeout 180 "$PY" -m pytest -m gpu tests/gpu -n 0 -rs -p no:cacheprovider \
    --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 300 "$PY" benchmarks/gpu/check.py --device cuda --out "$OUT_DIR" "$@"
check_rc=$?
echo "gpu tests rc=$tests_rc, check rc=$check_rc (results in $OUT_DIR)"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
