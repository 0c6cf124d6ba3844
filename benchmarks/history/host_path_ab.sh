#!/bin/bash
# In-engine A/B of two trees on the 11M offline run (BENCHMARKS.md, "Host path per decode
# step"): offline_worker.py alternating BEFORE and AFTER at 1 and 2 torch threads, one
# --profile-breakdown run each, then host_phases.py per tree (1 thread). Run through quiet.
#   BEFORE=<tree> AFTER=<tree> [PY=python] [MODEL=...] [ROUNDS=2] benchmarks/history/host_path_ab.sh OUT
# ROUNDS: before/after pairs per thread count (each run is ~1.5 s of generation: more pairs
# show the spread).
set -u
OUT=$1
PY=${PY:-python}
MODEL=${MODEL:-/work/venvs/hostpath-models/qwen3moe-11m}
declare -A TREE=([before]=$BEFORE [after]=$AFTER)
run() {   # name threads [extra args]
  local T=${TREE[$1]} th=$2; shift 2
  (cd "$T/benchmarks/vs_vllm" && OMP_NUM_THREADS=$th PYTHONPATH=$T:. $PY offline_worker.py \
    wideserve "$MODEL" --num-prompts 64 --input-len 128 --output-len 128 --threads "$th" "$@" \
    2>/dev/null | tail -1)
}
echo "# $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT"
for th in 1 2; do
  for _ in $(seq "${ROUNDS:-2}"); do
    for name in before after; do echo "$name threads=$th $(run $name $th)" >> "$OUT"; done
  done
  for name in before after; do
    echo "$name threads=$th breakdown $(run $name $th --profile-breakdown)" >> "$OUT"
  done
done
for name in before after; do
  T=${TREE[$name]}
  echo "$name host_phases" >> "$OUT"
  (cd "$T" && OMP_NUM_THREADS=1 PYTHONPATH=$T $PY "$(dirname "$(readlink -f "$0")")/host_phases.py" "$MODEL" \
    2>/dev/null | tail -12) >> "$OUT"
done
echo "# end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT"
