#!/bin/bash
# A/B of offline_switches.py configurations of one tree, alternating, breakdown runs, 11M model
# (BENCHMARKS.md, "KV write in the op, lazy KV pool"); one summary line per run.
#   offline_switches_ab.sh THREADS ROUNDS "FUSED HUGE EAGER" ...
# e.g. MODEL=MODELS_DIR/qwen3moe-11m offline_switches_ab.sh 1 2 "0 0 1" "1 0 0" "1 1 0";
# WS_PY: the interpreter (default python3 on PATH), MODEL: the model directory (required).
set -e
tree=$(cd "$(dirname "$0")/../.." && pwd)
py=${WS_PY:-python3}
model=${MODEL:?set MODEL to the 11M model directory (make_models.py)}
t=$1; n=$2; shift 2
cfgs=("$@")
cd "$tree/benchmarks/vs_vllm"
for i in $(seq "$n"); do for cfg in "${cfgs[@]}"; do
  read -r f h e <<< "$cfg"
  r=$(FUSED=$f HUGE=$h EAGER=$e OMP_NUM_THREADS=$t PYTHONPATH=$tree:. "$py" offline_switches.py \
      wideserve "$model" --num-prompts 64 --input-len 128 --output-len 128 --profile-breakdown \
      --threads "$t" 2>/dev/null | tail -1)
  echo "fused=$f huge=$h eager=$e t=$t $r" | python3 -c "
import sys, json
head, js = sys.stdin.read().split(' {', 1); d = json.loads('{' + js); b = d['breakdown_ms_per_step']
print(head, 'tok/s %.0f startup %.2f fwd %.2f attn %.2f op %.2f moe %.2f other %.2f sched %.2f '
      'sample %.2f output %.2f' % (d['out_tok_s'], d['startup_s'], b['forward'], b['forward.attention'],
      b['forward.attention_op'], b['forward.moe'], b['forward.other'], b['schedule'], b['sample'],
      b['output']))"
done; done
