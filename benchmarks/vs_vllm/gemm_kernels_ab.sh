#!/bin/bash
# The small-M GEMM micro-kernel (linears, LM head, fused router) and the fused experts' own
# map/load counting against the tree before them (BENCHMARKS.md, "Small-M GEMMs"):
# microbenchmarks, the in-process A/B of the GEMM kernel on/off, and the in-engine step split
# (offline_worker --profile-breakdown) of a BASE tree and this one, alternated.
#   WS_PY=.venv/bin/python benchmarks/vs_vllm/gemm_kernels_ab.sh BASE_TREE MODELS_DIR
set -u
BASE=$(realpath "$1")
MODELS=$(realpath "$2")
cd "$(dirname "$0")/../.."
HERE=$PWD
export OMP_NUM_THREADS=1
PY=${WS_PY:-python}
stamp() { echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*"; }
stamp "git $(git rev-parse --short HEAD), base $BASE"
PYTHONPATH=$HERE $PY benchmarks/gemm_linear.py --rows 1,64,512 --rounds 15
stamp
PYTHONPATH=$HERE $PY benchmarks/moe_experts.py --impls fused --tokens 1,64,512 --rounds 7
stamp
PYTHONPATH=$HERE $PY benchmarks/vs_vllm/ab_fast_paths.py $MODELS/qwen3moe-11m 64 128 +norm+qkr,+gemm
for spec in "qwen3moe-11m 64" "qwen3moe-653m 16"; do
  set -- $spec
  for round in 1 2; do
    for tree in "$BASE" "$HERE"; do
      stamp "$1 round $round tree $tree"
      (cd "$tree" && PYTHONPATH=$tree $PY benchmarks/vs_vllm/offline_worker.py wideserve \
        $MODELS/$1 --num-prompts $2 --input-len 128 --output-len 128 --profile-breakdown)
    done
  done
done
stamp done
