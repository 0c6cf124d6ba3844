#!/bin/bash
# Follow-up A/B (BENCHMARKS.md, "Small-M GEMMs"): two trees alternated, 2 rounds each: the LM
# head and router rows of benchmarks/gemm_linear.py, then the 11M offline step split.
#   WS_PY=.venv/bin/python benchmarks/vs_vllm/gemm_followup_ab.sh BASE_TREE NEW_TREE MODELS_DIR
set -u
BASE=$(realpath "$1"); NEW=$(realpath "$2"); MODELS=$(realpath "$3")
PY=${WS_PY:-python}
export OMP_NUM_THREADS=1
stamp() { echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*"; }
stamp
for r in 1 2; do for tree in "$BASE" "$NEW"; do
  stamp "round $r tree $tree ($(git -C $tree rev-parse --short HEAD))"
  (cd $tree && PYTHONPATH=$tree $PY benchmarks/gemm_linear.py --rows 64,512 --rounds 15 | grep "lm_head\|top-")
done; done
for r in 1 2; do for tree in "$BASE" "$NEW"; do
  stamp "offline 11M round $r tree $tree"
  (cd $tree && PYTHONPATH=$tree $PY benchmarks/vs_vllm/offline_worker.py wideserve \
    $MODELS/qwen3moe-11m --num-prompts 64 --input-len 128 --output-len 128 --profile-breakdown)
done; done
stamp done
