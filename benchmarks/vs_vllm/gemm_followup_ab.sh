#!/bin/bash
# Follow-up A/B (BENCHMARKS.md, "Small-M GEMMs"): main (without the LM-head prefetch and the
# vectorised router softmax) against this worktree, alternated; paths as used on 2026-12-01.
#   /work/notes/quiet benchmarks/vs_vllm/gemm_followup_ab.sh
echo "== $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in 1 2; do for tree in /work/main /work/wt/kgemm; do
  echo "== round $r tree $tree ($(git -C $tree rev-parse --short HEAD)) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $tree && PYTHONPATH=$tree OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/gemm_linear.py --rows 64,512 --rounds 15 | grep "lm_head\|top-")
done; done
for r in 1 2; do for tree in /work/main /work/wt/kgemm; do
  echo "== offline 11M round $r tree $tree load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $tree && PYTHONPATH=$tree OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/vs_vllm/offline_worker.py wideserve /work/venvs/hostpath-models/qwen3moe-11m --num-prompts 64 --input-len 128 --output-len 128 --profile-breakdown)
done; done
echo "== $(date -u +%T) done load $(cut -d' ' -f1-3 /proc/loadavg)"
