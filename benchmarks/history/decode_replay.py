"""The decode forward inside the engine against the same batch replayed (BENCHMARKS.md,
"Decode forward in the engine").

  OMP_NUM_THREADS=1 PYTHONPATH=<tree> python benchmarks/history/decode_replay.py MODEL [--threads N]

64 token-id prompts of 128 -> 128 tokens, greedy, EOS ignored (the vs_vllm offline workload),
run twice; in the second run `DecoderModel.forward` is timed (thread CPU time, and minor page
faults) at every decode step, and at steps STEPS the same batch is replayed REPEATS times at
once, while its requests still run. Each of those batches is replayed again after the run.

The two replays differ in what they read: after the run `BlockTables.drop` has zeroed the
finished requests' block-table rows, so every request of the replayed batch attends to the
null block alone, and the forward reads almost no KV. Session 6's "the forward costs 1.5-2x
more in the engine than replayed alone" compared against that replay; the live replay, whose
rows are valid, costs what the engine's forward costs.
"""
from __future__ import annotations

import resource
import time

from offline_workload import offline_workload

STEPS = (10, 60, 120)
REPEATS = 5


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    llm, prompts, sp, threads = offline_workload(__doc__)
    import torch
    from wideserve.models.llama import model as llama

    llm.generate(prompts, sp, use_tqdm=False)
    inner = llama.DecoderModel.forward
    steps: list[tuple[float, int]] = []          # (thread CPU s, minor faults) per decode
    live: dict[int, tuple[object, list[float]]] = {}

    def timed(self, batch):
        f0, c0 = _minflt(), time.thread_time()
        out = inner(self, batch)
        if batch.num_tokens != len(batch.seq_lens_cpu):
            return out                           # prefill: not a decode step
        steps.append((time.thread_time() - c0, _minflt() - f0))
        if len(steps) in STEPS:
            again = []
            for _ in range(REPEATS):
                c0 = time.thread_time()
                inner(self, batch)               # rewrites this step's KV with the same values
                again.append(time.thread_time() - c0)
            live[len(steps)] = (batch, again)
        return out

    llama.DecoderModel.forward = timed
    llm.generate(prompts, sp, use_tqdm=False)
    llama.DecoderModel.forward = inner
    n = len(steps)
    print(f"threads {threads}: {n} decode steps, in-engine forward "
          f"{1e3 * sum(s for s, _ in steps) / n:.2f} ms thread CPU, "
          f"{sum(f for _, f in steps) / n:.1f} minor faults per forward")
    model = llm.engine.runner.model.model
    with torch.inference_mode():
        for k, (batch, again) in live.items():
            after = []
            for _ in range(REPEATS):
                c0 = time.thread_time()
                inner(model, batch)
                after.append(time.thread_time() - c0)
            view = batch.kv_groups[0]
            nonzero = int(view.block_table[view.req_rows].count_nonzero())
            print(f"  step {k}: in-engine {1e3 * steps[k - 1][0]:.2f} ms, replayed live "
                  f"{1e3 * min(again):.2f} ms, replayed after the run {1e3 * min(after):.2f} ms "
                  f"(block-table entries left: {nonzero})")


if __name__ == "__main__":
    main()
