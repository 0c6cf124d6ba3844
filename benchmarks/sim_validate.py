"""Held-out validation of the rack simulator on this machine (docs/simulator.md, table A).

1. Calibrate on ONE rank (wideserve/sim/calibrate.py): the engine's host and forward time per
   step at batches 1, 4, 8 of a many-expert Qwen3-MoE (dummy weights, the DEP benchmark's
   config), the expert op vs rows, gloo collectives, host jitter.
2. Predict a DEP2 run at `--per-rank` requests per rank from that profile alone.
3. Run the real engine at DEP2 (benchmarks/dep_scaling.py's harness) and compare step time.

    python benchmarks/sim_validate.py --out benchmarks/results/sim_validate.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def predict_dep(profile, model_dir: str, ranks: int, per_rank: int, ctx: float,
                sync_algo: str) -> dict:
    import numpy as np

    from wideserve.sim.model import load_model
    from wideserve.sim.step import StepInputs, StepModel
    m = load_model(model_dir, "fp32")
    sm = StepModel(m, profile.as_hardware(), profile)
    rng = np.random.default_rng(0)
    steps, parts = [], {}
    for _ in range(300):                 # average over draws of the measured noise
        st = sm.step(StepInputs(
            ranks, [per_rank] * ranks, [ctx] * ranks, sync_algo=sync_algo, overlap_host=False,
            jitter=list(sm.noise.draw(sm.host_s(per_rank, per_rank), (ranks,), rng)),
            noise=True))
        steps.append(st.step_s)
        for k, v in st.parts.items():
            parts[k] = parts.get(k, 0.0) + v / 300
    return {"step_ms": 1e3 * float(np.mean(steps)),
            "parts_ms": {k: 1e3 * v for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--out", default="benchmarks/results/sim_validate.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from dep_scaling import CONFIG, run_size

    from wideserve.sim.calibrate import calibrate, temp_model_dir
    model_dir = temp_model_dir(CONFIG)
    profile = calibrate(model_dir, [1, 4, 8], args.prompt_len, args.output_len, 1, (2,))
    ns = argparse.Namespace(per_rank=args.per_rank, prompt_len=args.prompt_len,
                            output_len=args.output_len)
    measured = run_size(model_dir, 2, ns)
    s = measured["step_split"]
    # The decode step a user sees: 1 / (P50 tokens/s per user). The per-step split of a
    # DEP run averages in dummy steps (an idle rank's 1-token batches), so it is reported
    # but not compared.
    meas_step = 1e3 / measured["p50_user_tok_s"]
    algo = "rd" if measured.get("sync", {}).get("method") == "rd" else "ring"
    ctx = args.prompt_len + args.output_len / 2
    pred = predict_dep(profile, model_dir, 2, args.per_rank, ctx, algo)
    rows = [{"quantity": f"DEP2 decode step, {args.per_rank} req/rank (ms)",
             "predicted": pred["step_ms"], "measured": meas_step,
             "error": pred["step_ms"] / meas_step - 1}]
    for r in rows:
        print(f"{r['quantity']:28s} predicted {r['predicted']:8.2f}  measured "
              f"{r['measured']:8.2f}  error {100 * r['error']:+.0f}%")
    from wideserve.sim.calibrate import write_profile
    write_profile(profile, Path(args.out).with_name("sim_profile.json"))
    prof = profile.to_dict()
    prof["profile"]["host"]["jitter_s"] = prof["profile"]["host"]["jitter_s"][:50]
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(),
        "rows": rows, "prediction": pred, "measured": measured, "profile": prof}, indent=1))


if __name__ == "__main__":
    main()
