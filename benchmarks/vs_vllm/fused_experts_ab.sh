#!/bin/bash
# The fused routed-experts op against the previous CPU expert paths (BENCHMARKS.md, "Fused
# routed experts"): the expert microbenchmark, then the in-process A/B on both Qwen3-MoE models.
#   WS_PY=.venv/bin/python benchmarks/vs_vllm/fused_experts_ab.sh MODELS_DIR
set -u
MODELS=$(realpath "$1")
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
PY=${WS_PY:-python}
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) git $(git rev-parse --short HEAD)"
$PY benchmarks/moe_experts.py --dtype bfloat16 --impls loop,grouped_mm,packed,fused --rounds 5
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
$PY benchmarks/vs_vllm/ab_fast_paths.py $MODELS/qwen3moe-11m 64 64 attn+pack,fused
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
$PY benchmarks/vs_vllm/ab_fast_paths.py $MODELS/qwen3moe-653m 32 24 all,fused
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
$PY benchmarks/vs_vllm/ab_fast_paths.py $MODELS/qwen3moe-653m 16 48 all,fused
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
