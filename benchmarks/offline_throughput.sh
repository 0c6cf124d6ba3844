#!/usr/bin/env bash
# Offline throughput: wideserve (LLM.generate) against transformers generate() on identical
# token-id prompts, greedy, ignore_eos, fp32, one thread; repeats alternate the backends and
# the median run is reported (BENCHMARKS.md, "Offline throughput").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
W="--dtype float32 --threads 1 --num-prompts 32 --input-len 128 --output-len 64 --repeats 3 --no-progress"
echo "== bundled shakespeare-v4-tiny ($(uptime | sed 's/.*load/load/'))"
.venv/bin/wideserve bench throughput $W --backend both \
  --output-json "$OUT/offline_v4tiny.json"
QWEN=benchmarks/configs/qwen3-moe-small
for hfb in 1 32; do
  echo "== qwen3-moe-small dummy, transformers batch $hfb ($(uptime | sed 's/.*load/load/'))"
  .venv/bin/wideserve bench throughput "$QWEN" --load-format dummy $W --backend both \
    --hf-batch-size "$hfb" --output-json "$OUT/offline_qwen3moe_hfbatch$hfb.json"
done
echo "== done ($(uptime | sed 's/.*load/load/'))"
