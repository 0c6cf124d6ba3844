"""What the workload's sampling costs a decode step, the calibration term the P/D held-out
row measures with (docs/simulator.md): the bundled V4 tiny model's decode step (host +
forward, calibrate.measure_engine) at batches 1, 2, 4, greedy against temperature 1.0 (the
default a server gives requests that send none), alternated so a drifting load cancels.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sim_sampling_cost.py OUT.json [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from wideserve.sim.calibrate import measure_engine
    from wideserve.worker.model_loader import BUNDLED_MODEL
    kw = {"load_format": "auto", "dtype": "auto", "block_size": None}
    batches, rows = [1, 2, 4], []
    for rnd in range(args.rounds):
        for t in (0.0, 1.0):
            got = measure_engine(str(BUNDLED_MODEL), batches, 256, 24, kw, reps=3,
                                 keep="mean", temperature=t)
            ms = [1e3 * (r["host"] + r["forward"]) for r in got]
            rows.append({"round": rnd, "temperature": t, "step_ms": ms})
            print(f"round {rnd} temperature {t}: " + "  ".join(
                f"B={b} {x:.2f} ms" for b, x in zip(batches, ms)), flush=True)
    mean = {t: [statistics.mean(r["step_ms"][i] for r in rows if r["temperature"] == t)
                for i in range(len(batches))] for t in (0.0, 1.0)}
    print("mean, temperature 1.0 vs greedy: " + "  ".join(
        f"B={b} {a:.2f} vs {g:.2f} ms ({100 * (a / g - 1):+.0f}%)"
        for b, g, a in zip(batches, mean[0.0], mean[1.0])))
    Path(args.out).write_text(json.dumps({"batches": batches, "rows": rows, "mean_ms": {
        str(t): v for t, v in mean.items()}, "load_end": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
