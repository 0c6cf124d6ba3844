"""The lean CPU decoder forward against the module path, paired on live batches (BENCHMARKS.md,
"Lean decoder forward"; docs/cpu_kernels.md).

  OMP_NUM_THREADS=N PYTHONPATH=<tree> python benchmarks/history/lean_decode_ab.py MODEL [--threads N]

The vs_vllm offline workload (64 token-id prompts of 128 -> 128, greedy, EOS ignored). At every
EVERY-th decode step the step's batch, whose requests are still running (its block-table rows
valid: benchmarks/history/decode_replay.py says why that matters), is replayed ROUNDS times with the
lean path on and off in turn (each replay rewrites the step's KV with the same values), so
both see the same cache state; the median and min thread-CPU and wall ms per forward follow.
"""
from __future__ import annotations

import statistics
import time

from offline_workload import offline_workload

EVERY = 20
ROUNDS = 10


def main() -> None:
    llm, prompts, sp, threads = offline_workload(__doc__)
    from wideserve.models.llama import model as llama

    inner = llama.DecoderModel.forward
    decodes = [0]
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}

    def paired(self, batch):
        out = inner(self, batch)
        if batch.num_tokens == len(batch.seq_lens_cpu):
            decodes[0] += 1
            if decodes[0] % EVERY == 0:
                for _ in range(ROUNDS):
                    for lean in (True, False):
                        self.lean_decode = lean
                        c0, t0 = time.thread_time(), time.perf_counter()
                        inner(self, batch)
                        times[lean].append((time.thread_time() - c0, time.perf_counter() - t0))
                self.lean_decode = True
        return out

    llama.DecoderModel.forward = paired
    llm.generate(prompts, sp, use_tqdm=False)
    for lean in (False, True):
        cpu = [1e3 * c for c, _ in times[lean]]
        wall = [1e3 * w for _, w in times[lean]]
        print(f"threads {threads} {'lean  ' if lean else 'module'}: thread CPU median "
              f"{statistics.median(cpu):.3f} min {min(cpu):.3f} | wall median "
              f"{statistics.median(wall):.3f} min {min(wall):.3f} ms per forward (n={len(cpu)})")


if __name__ == "__main__":
    main()
