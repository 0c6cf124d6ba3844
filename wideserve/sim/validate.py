"""Held-out prediction on this machine, small enough for the test suite.

One engine start: decode steps are measured at the calibration batches and at a held-out
batch; the profile is built from the calibration batches only, and the simulator predicts the
held-out batch's decode step. benchmarks/sim_validate.py runs the full table (DEP2, MTP k=3,
EPLB) the same way at larger sizes.
"""
from __future__ import annotations

from typing import Any

from wideserve.sim.calibrate import _dense_rows, host_fit, measure_engine, temp_model_dir
from wideserve.sim.hardware import Profile
from wideserve.sim.model import load_model
from wideserve.sim.step import StepInputs, StepModel


def profile_from_rows(rows: list[dict[str, float]]) -> Profile:
    """A one-rank profile from measured engine rows (forward incl. experts: one rank runs
    them all, so the expert table is empty and the dense table is the whole forward)."""
    base, per_req = host_fit(rows)
    dense = {"tokens": [float(r["batch"]) for r in rows], "s": [r["forward"] for r in rows]}
    return Profile("this machine", {"base_s": base, "per_request_s": per_req,
                                    "per_token_s": 0.0, "jitter_s": []},
                   {"allreduce_alpha_s": 0.0, "alltoall": {"alpha_s": 0.0, "bytes_per_s": 1.0}},
                   {"expert": {"rows": [1], "s": [0.0]}, "dense_forward": dense,
                    "engine_rows": rows}, 1.0, 1.0)


def single_rank_heldout(config: dict[str, Any], cal: list[int], held: int,
                        prompt_len: int = 8, output_len: int = 6) -> list[dict[str, Any]]:
    model_dir = temp_model_dir(config)
    # Three runs of each length, the least disturbed kept: one run of each on a loaded
    # machine gave a negative step time (the short run delayed more than the long one).
    rows = measure_engine(model_dir, sorted(cal + [held]), prompt_len, output_len, reps=3)
    by_batch = {int(r["batch"]): r for r in rows}
    prof = profile_from_rows([by_batch[b] for b in sorted(cal)])
    sm = StepModel(load_model(model_dir, "fp32"), prof.as_hardware(), prof)
    pred = sm.step(StepInputs(1, [held], [prompt_len + output_len / 2.0],
                              overlap_host=False)).step_s
    r = by_batch[held]
    meas = r["forward"] + r["host"]
    return [{"quantity": f"1-rank decode step at B={held} from B={sorted(cal)} (ms)",
             "predicted": 1e3 * pred, "measured": 1e3 * meas, "error": pred / meas - 1}]
