"""Host time per decode step of one offline run, by component (BENCHMARKS.md, "Host path per
decode step").

  OMP_NUM_THREADS=1 PYTHONPATH=<tree> python benchmarks/history/host_phases.py MODEL [--threads N]

64 token-id prompts of 128 -> 128 tokens, greedy, EOS ignored (the vs_vllm offline workload).
Named functions of the engine loop are wrapped with timers reading the thread's CPU time (a
shared machine's other processes then cost little), and the means over the decode steps of
the second of two runs are printed, in ms per step: scheduler.schedule, the step requests,
runner.build_batch, the model forward, compute_logits (LM head), the runner as a whole, the
sampler, the scheduler's update, the output processor (detokeniser included), the engine
step and the whole loop iteration. The wrappers cost ~1 us each, a few per step.
"""
from __future__ import annotations

import collections
import functools
import time

from offline_workload import offline_workload


def main() -> None:
    llm, prompts, sp, threads = offline_workload(__doc__)
    from wideserve.engine import engine_core, scheduler
    from wideserve.serving import output_processor
    from wideserve.worker import model_runner
    from wideserve.engine import step_worker as worker
    from wideserve.models.llama import model as llama
    from wideserve.types.sampling_params import SamplingParams

    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    cur: dict[str, float] = collections.defaultdict(float)
    steps: list[dict[str, float]] = []

    def timed(cls, name: str, key: str) -> None:
        f = getattr(cls, name)

        @functools.wraps(f)
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                cur[key] += time.thread_time() - t0
        setattr(cls, name, wrapper)

    for cls, name in ((scheduler.Scheduler, "schedule"), (scheduler.Scheduler, "update_from_output"),
                      (worker.Worker, "_step_request"), (worker.Worker, "_sample"),
                      (engine_core.EngineCore, "step"), (model_runner.ModelRunner, "build_batch"),
                      (model_runner.ModelRunner, "forward"), (llama.DecoderModel, "forward"),
                      (llama.DecoderForCausalLM, "compute_logits"),
                      (output_processor.OutputProcessor, "process_outputs")):
        timed(cls, name, f"{cls.__name__}.{name}")
    inner_step, inner_process = llm.engine.step, llm.processor.process_outputs

    def step():
        cur.clear()
        cur["_t0"] = time.thread_time()
        return inner_step()

    def process(outs):
        r = inner_process(outs)
        d = dict(cur)
        d["loop iteration"] = time.thread_time() - d.pop("_t0")
        steps.append(d)
        return r
    llm.engine.step, llm.processor.process_outputs = step, process
    for _ in range(2):
        steps.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    decode = [s for s in steps if s.get("DecoderModel.forward", 1.0) < 0.02]
    print(f"threads {threads}: elapsed {elapsed:.3f} s, {len(steps)} steps, "
          f"{len(decode)} decode steps; thread CPU ms per decode step:")
    for key in sorted({k for s in decode for k in s}):
        print(f"  {key:40s} {1e3 * sum(s.get(key, 0.0) for s in decode) / len(decode):7.3f}")


if __name__ == "__main__":
    main()
