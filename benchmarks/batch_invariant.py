"""The cost of --batch-invariant (docs/cpu_kernels.md, "Batch invariance"): offline output
tokens/s and TTFT of the default mode and the mode, side by side in one process, runs
alternating (a burst of load from elsewhere hits both alike), bf16 greedy, kernels chosen by
measurement (WIDESERVE_GEMM=auto unless set).

  PYTHONPATH=. python benchmarks/batch_invariant.py [--model DIR|bundled|v41] ...
      [--prompts 32] [--input 128] [--output 64] [--ttft-input 512] [--rounds 3]

Offline: --prompts prompts of --input random tokens -> --output tokens each, all submitted
at once; out tok/s = generated tokens / wall time. TTFT: one --ttft-input-token prompt alone,
one output token. Per model it prints the median over --rounds of each, and the mode's ratio
to the default (also asserting the mode's tokens equal alone and in the batch, which the
default need not). `lscpu` model and ISA flags and the load average head the output.

--parts (DeepSeek-V4/V4.1): what each part of the mode costs. Engines: the default, the
mode, then the mode with its parts switched off one after another - "-gemms" with the
model's nn.Linear modules and functional GEMM sites back on F.linear (no InvariantLinear /
FunctionalLinear), "-long" also with LONG_QUERY prefill blocks, "-dense" also with CSA
dense where top-k covers every entry. A measurement patch of this process (the later
engines are no longer invariant), not a setting.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import warnings
from pathlib import Path

os.environ.setdefault("WIDESERVE_GEMM", "auto")

import torch  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402

ASSETS = Path(__file__).parents[1] / "wideserve" / "assets"


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                  if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines()
                  if ln.startswith("Flags")), [])
    isa = " ".join(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f")))
    return f"{model}; {isa}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}"


def model_path(name: str) -> str | None:
    return {"bundled": None, "v41": str(ASSETS / "shakespeare-v41-tiny")}.get(name, name)


# Wall time by default; --cpu-time: this process's CPU time (the offline engine runs in it,
# one torch thread), which waiting for a core on a loaded machine does not inflate.
CLOCK = {"fn": time.perf_counter}


def run(llm: LLM, prompts: list[list[int]], out: int) -> tuple[float, list]:
    sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    t0 = CLOCK["fn"]()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return CLOCK["fn"]() - t0, [list(o.outputs[0].token_ids) for o in outs]


def _switch_parts(off: set[str]) -> None:
    """Patch V4Step so that the step of the next run has the parts in `off` switched off
    (--parts; the set is read at each call)."""
    from wideserve.layers.attention import registry, v41_batched, v4_batched, v4_step

    def relaxed(part: str, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            step = next(x for x in args if isinstance(x, v4_step.V4Step))
            keep = step.batch_invariant
            step.batch_invariant = keep and part not in off
            try:
                return fn(*args, **kwargs)
            finally:
                step.batch_invariant = keep
        return call

    v4_step.V4Step.query_groups = relaxed("long", v4_step.V4Step.query_groups)
    # The backend tables hold the select functions themselves (frozen records): swap them.
    for table in (registry.ATTENTION_BACKENDS, registry.V41_ATTENTION_BACKENDS):
        for backend in table.values():
            if backend.select in (v4_batched.select, v41_batched.select):
                object.__setattr__(backend, "select", relaxed("dense", backend.select))


def _plain_gemms(model: torch.nn.Module) -> None:
    """The model's invariant GEMM sites back to F.linear (--parts "-gemms")."""
    from wideserve.layers.linear import FunctionalLinear, use_invariant_linears
    use_invariant_linears(model, False)
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, FunctionalLinear):
                value.batch_invariant = False


def bench_parts(name: str, a: argparse.Namespace) -> None:
    off: set[str] = set()
    _switch_parts(off)
    variants = {"default": set(), "invariant": set(), "-gemms": {"gemms"},
                "-gemms-long": {"gemms", "long"},
                "-gemms-long-dense": {"gemms", "long", "dense"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llms = {m: LLM(model_path(name), dtype="bfloat16", skip_tokenizer_init=True,
                       enable_prefix_caching=False, batch_invariant=m != "default",
                       max_num_seqs=max(a.prompts, 8)) for m in variants}
    for m, parts in variants.items():
        if "gemms" in parts:
            _plain_gemms(llms[m].engine.worker.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (a.input,), generator=gen).tolist()
               for _ in range(a.prompts)]
    long = torch.randint(2, 1000, (a.ttft_input,), generator=gen).tolist()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in llms}
    for m, llm in llms.items():
        off.clear()
        off.update(variants[m])
        run(llm, prompts[:2], 2)
    for _ in range(a.rounds):
        for m, llm in llms.items():
            off.clear()
            off.update(variants[m])
            times[m].append((run(llm, prompts, a.output)[0], run(llm, [long], 1)[0]))
    base = [statistics.median(t[i] for t in times["default"]) for i in (0, 1)]
    for m in llms:
        tput, ttft = (statistics.median(t[i] for t in times[m]) for i in (0, 1))
        print(f"{name} {m}: run {tput:.2f} s (x{tput / base[0]:.2f} the default's time), "
              f"TTFT {ttft * 1e3:.0f} ms (x{ttft / base[1]:.2f})", flush=True)
    for llm in llms.values():
        llm.shutdown()


def bench(name: str, a: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    llms = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("default", "invariant"):
            llms[mode] = LLM(model_path(name), dtype="bfloat16", skip_tokenizer_init=True,
                             enable_prefix_caching=False, batch_invariant=mode == "invariant",
                             max_num_seqs=max(a.prompts, 8))
    vocab = llms["default"].engine.vocab_size if hasattr(llms["default"].engine,
                                                         "vocab_size") else 1000
    vocab = min(vocab, 1000)
    prompts = [torch.randint(2, vocab, (a.input,), generator=gen).tolist()
               for _ in range(a.prompts)]
    long = torch.randint(2, vocab, (a.ttft_input,), generator=gen).tolist()
    tput: dict[str, list[float]] = {m: [] for m in llms}
    ttft: dict[str, list[float]] = {m: [] for m in llms}
    tokens: dict[str, list] = {}
    for m, llm in llms.items():                        # warm: kernel timing, first calls
        run(llm, prompts[:2], 2)
    for _ in range(a.rounds):
        for m, llm in llms.items():
            dt, tokens[m] = run(llm, prompts, a.output)
            tput[m].append(a.prompts * a.output / dt)
            ttft[m].append(run(llm, [long], 1)[0])
    alone = run(llms["invariant"], prompts[:1], a.output)[1][0]
    assert alone == tokens["invariant"][0], "the mode's tokens depend on the batch"
    med = {m: (statistics.median(tput[m]), statistics.median(ttft[m]) * 1e3) for m in llms}
    same = sum(x == y for x, y in zip(tokens["default"], tokens["invariant"]))
    print(f"{name}: out tok/s default {med['default'][0]:.0f}, invariant "
          f"{med['invariant'][0]:.0f} (x{med['invariant'][0] / med['default'][0]:.2f}); "
          f"TTFT {a.ttft_input} tok default {med['default'][1]:.1f} ms, invariant "
          f"{med['invariant'][1]:.1f} ms (x{med['invariant'][1] / med['default'][1]:.2f}); "
          f"greedy outputs equal to the default's: {same}/{a.prompts}", flush=True)
    for llm in llms.values():
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["bundled", "v41"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--ttft-input", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", action="store_true",
                   help="V4/V4.1: the cost of each part of the mode (module docstring)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time runs by this process's CPU time, not wall time (a loaded "
                        "machine: the wait for a core is not counted)")
    a = p.parse_args()
    if a.cpu_time:
        CLOCK["fn"] = time.process_time
    print(machine(), f"threads {torch.get_num_threads()}, "
          f"WIDESERVE_GEMM={os.environ['WIDESERVE_GEMM']}, "
          f"clock {'CPU' if a.cpu_time else 'wall'}", flush=True)
    for name in a.model:
        (bench_parts if a.parts else bench)(name, a)


if __name__ == "__main__":
    main()
