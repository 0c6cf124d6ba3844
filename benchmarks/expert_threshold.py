"""The routed experts' brgemm threshold (docs/cpu_kernels.md, "Expert thresholds"): the
micro-kernel's and brgemm's time on one expert of a model around the rows where they cross,
and the threshold the kernel choice finds with its bisection narrowed to the policy's
resolution (the default) and with three fixed timings (before session 37), with the time each
calibration of the model's shapes took. BENCHMARKS.md, "Zen 5: the goals per run".

  PYTHONPATH=.:benchmarks python benchmarks/expert_threshold.py [--model 11m|653m]
      [--threads 1] [--rows 64 70 76 ...] [--rounds 2] [--quant-experts mxfp4 fp8 nvfp4]

The curve times each row count as the choice does (candidates alternating, cold weights up to
64 rows, `time_interleaved` on the thread's CPU time at one thread); the calibrations build a
fresh table each (no disk cache), the two policies alternating over --rounds.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from wideserve.kernels import choice as ch
from wideserve.kernels import loader
from wideserve.kernels.candidates import Pools

from kernel_choice import MODELS, calibrate, shapes   # benchmarks/: the models' GEMM shapes


def curve(model: str, rows: list[int], reps: int) -> list[str]:
    """us per call of micro and brgemm on the model's expert at each row count."""
    d, inter = MODELS[model][0], MODELS[model][6]
    pools, out = Pools(), []
    for r in rows:
        fns = {c: ch.candidate("experts", c, (inter, d), r, pools) for c in ("micro", "brgemm")}
        t = {c: statistics.median(v) * 1e6
             for c, v in ch.time_interleaved(fns, reps, reps, 0.0, "auto").items()}
        out.append(f"{r:5d} rows: micro {t['micro']:8.1f} us, brgemm {t['brgemm']:8.1f} us, "
                   f"micro / brgemm {t['micro'] / t['brgemm']:.2f}")
    return out


def thresholds(model: str, quant: tuple[str, ...], **policy) -> tuple[float, list[int | None]]:
    """Seconds to time the model's shapes afresh under `policy`, and each expert family's
    threshold (read from the timed table)."""
    kc = ch.KernelChoice(ch.KernelPolicy(cache_dir=None, **policy))
    secs = calibrate(kc, model, quant)
    return secs, [kc.brgemm_from(family, n, k, torch.bfloat16, extra=extra)
                  for _, family, n, k, extra in shapes(model, quant)
                  if family in ch.THRESHOLD_FAMILIES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="11m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+",
                    default=[48, 56, 64, 67, 70, 76, 82, 87, 88, 96, 112, 128])
    ap.add_argument("--reps", type=int, default=15, help="alternating calls per row count")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quant-experts", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loader.build()
    print(f"{args.model} experts, {args.threads} thread(s)")
    print("\n".join(curve(args.model, args.rows, args.reps)))
    quant = tuple(args.quant_experts)
    policies = {"narrowed (default)": {}, "three timings (before)": {"crossover_steps": 3,
                                                                      "crossover_resolution": 0}}
    for rnd in range(args.rounds):
        for name, policy in policies.items():
            secs, found = thresholds(args.model, quant, **policy)
            print(f"round {rnd} {name}: calibration {secs:.2f} s, thresholds {found}")


if __name__ == "__main__":
    main()
