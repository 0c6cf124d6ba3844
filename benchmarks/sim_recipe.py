"""The rack simulator against the recipe's published figures (docs/simulator.md, table B).

V4.1-Flash (tests/data/deepseek-v41-flash/config.json; FP8 dense, FP4 experts as the
checkpoint ships them), GB300 NVL72 hardware file, 128K context, 64 requests per GPU,
nextn = 3, host costs from a calibration profile of THIS machine (our engine's host path;
the recipe's engine and Grace host differ: see the notes). Nothing here is tuned to the
figures, with one labelled exception: the routing skew is an input (no V4.1 routing trace is
available), chosen so that the identity placement's balancedness equals the published
"before" value; the "after" value is then the prediction.

    python benchmarks/sim_recipe.py --profile benchmarks/results/sim_profile_recipe.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wideserve.sim.eplb import EplbSettings, EplbState, zipf_shares  # noqa: E402
from wideserve.sim.hardware import load_hardware, load_profile  # noqa: E402
from wideserve.sim.model import load_model  # noqa: E402
from wideserve.sim.pd import PDSettings  # noqa: E402
from wideserve.sim.simulator import Layout, Simulation  # noqa: E402
from wideserve.sim.workload import fixed  # noqa: E402

CTX, OUT, BATCH, K = 131072, 1024, 64, 3
ACCEPT = (0.8, 0.7, 0.6)    # assumed per-position acceptance (no published profile)


def skew_for(before: float, layers: int, experts: int, ranks: int) -> float:
    """The Zipf skew whose identity placement has this balancedness (bisection)."""
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        st = EplbState(zipf_shares(layers, experts, mid), ranks, EplbSettings())
        lo, hi = (mid, hi) if st.balancedness() > before else (lo, mid)
    return (lo + hi) / 2


def run(m, hw, prof, steps: int = 60, ctx: int = CTX, **kw) -> dict:
    lay = Layout(batch=BATCH, mtp_k=K, acceptance=ACCEPT, **kw)
    sim = Simulation(m, hw, prof, lay, fixed(ctx, OUT))
    r = sim.run(steps)
    return {"step_ms": r.step_ms, "parts_ms": r.breakdown_ms, "tok_s_gpu": r.tok_s_per_gpu,
            "p90_user": r.p90_user_tok_s, "balancedness": r.balancedness,
            "max_kv_loads": sim.max_loads}


def eplb_rows(m, ranks: int) -> list[dict]:
    out = []
    for name, layers, experts, before, after in (
            ("target", m.moe_layers, m.experts, 0.35, 0.94),
            ("draft", m.draft_layers, m.draft_experts, 0.21, 0.89)):
        skew = skew_for(before, layers, experts, ranks)
        st = EplbState(zipf_shares(layers, experts, skew), ranks,
                       EplbSettings(True, 3000, 1000, redundant=ranks))
        for step in range(3000):
            st.after_step(step, BATCH * ranks * (K + 1) * (m.top_k if name == "target"
                                                           else m.draft_top_k))
        out.append({"figure": f"EPLB {name} balancedness 0.35/0.21 -> (published {after})",
                    "published": after, "simulated": st.balancedness(),
                    "inputs": f"skew {skew:.2f} (conditioned on before={before}), "
                              f"{ranks} redundant experts, window 1000 of 3000 steps"})
    return out


def with_admission(prof):
    """The profile with the decode host's per-KV-load admission cost on V4.1-Flash's KV
    layout (measured here with the engine's scheduler/connector code unless the profile
    already holds one measured on a V4.1 layout)."""
    from wideserve.sim.calibrate_pd import measure_admission
    adm = prof.pd.get("admission")
    if not adm or "v41" not in str(adm.get("model", "")):
        adm = measure_admission(ROOT / "tests/data/deepseek-v41-flash", [4096, 32768, CTX])
        prof = dataclasses.replace(prof, pd={**prof.pd, "admission": adm})
    return prof


def kv_load_cap_rows(m, hw, prof) -> list[dict]:
    """"<= 4 KV loads per step: 460K -> 516K": the decode host's admission cost per KV load is
    measured with the engine's scheduler/connector code on V4.1-Flash's KV layout (128K
    context: calibrate_pd.measure_admission), unless the profile holds one; P/D as in the
    packed-push row, uncapped vs at most 4 loads per rank and step. Compared: the gain."""
    adm = prof.pd["admission"]
    out = {}
    for cap in (None, 4):
        r = run(m, hw, prof, steps=400, dep=32, sync_algo="rd",
                pd=PDSettings(prefill_instances=4, prefill_ranks=4, transfer="push",
                              max_kv_loads_per_step=cap))
        out[cap] = r
    gain = out[4]["tok_s_gpu"] / out[None]["tok_s_gpu"]
    return [{"figure": "P/D tokens/s/GPU gain from <= 4 KV loads per step (516K/460K)",
             "published": 516 / 460, "simulated": gain,
             "inputs": f"admission {1e3 * adm['s'][-1]:.1f} ms per load at "
                       f"{int(adm['tokens'][-1])} tokens (measured here); uncapped "
                       f"{out[None]['tok_s_gpu']:.0f}, capped {out[4]['tok_s_gpu']:.0f} "
                       f"tok/s/GPU; step {out[None]['step_ms']:.2f} -> "
                       f"{out[4]['step_ms']:.2f} ms; most loads one rank admitted in one "
                       f"step: {out[None]['max_kv_loads']} uncapped"}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", default="benchmarks/results/sim_recipe.json")
    args = ap.parse_args()
    m = load_model(ROOT / "tests/data/deepseek-v41-flash")
    m.weight_format, m.expert_format = "fp8", "fp4"
    hw, prof = load_hardware("gb300"), load_profile(args.profile)
    pd = PDSettings(prefill_instances=1)     # decode steps only: prompts prefill elsewhere
    rows = []
    d16 = run(m, hw, prof, dep=16, sync_algo="ring", pd=pd)
    d32 = run(m, hw, prof, dep=32, sync_algo="ring", pd=pd)
    rows += [{"figure": "DEP16 step, unoptimised host (ms)", "published": 13.84,
              "simulated": d16["step_ms"]},
             {"figure": "DEP32 step, unoptimised host (ms)", "published": 17.57,
              "simulated": d32["step_ms"]}]
    rd32 = run(m, hw, prof, dep=32, sync_algo="rd", pd=pd)
    rows += [{"figure": "DP sync, ring (ms)", "published": 10.8,
              "simulated": d32["parts_ms"]["dp_sync"]},
             {"figure": "DP sync, recursive doubling (ms)", "published": 1.5,
              "simulated": rd32["parts_ms"]["dp_sync"]},
             {"figure": "step with ring sync (ms)", "published": 16.10,
              "simulated": d32["step_ms"]},
             {"figure": "step with recursive doubling (ms)", "published": 13.15,
              "simulated": rd32["step_ms"]}]
    rows += eplb_rows(m, 32)
    for dep, pub in ((4, 13.4), (32, 6.0)):
        r = run(m, hw, prof, dep=dep, sync_algo="rd", pd=pd)
        rows.append({"figure": f"MoE time per step at DEP{dep} (ms)", "published": pub,
                     "simulated": r["parts_ms"]["moe"] + r["parts_ms"]["all_to_all"]})
    long = run(m, hw, prof, dep=32, sync_algo="rd", pd=pd, ctx=855_000)
    rows.append({"figure": "decode step increase 128K -> 855K context (ms)", "published": 0.6,
                 "simulated": long["step_ms"] - rd32["step_ms"]})
    prof = with_admission(prof)      # P/D rows: admitting a KV load costs the decode host
    for mode, pub in (("pull", 141e3), ("push", 440e3)):
        r = run(m, hw, prof, steps=400, dep=32, sync_algo="rd",
                pd=PDSettings(prefill_instances=4, prefill_ranks=4, transfer=mode))
        rows.append({"figure": f"P/D tokens/s/GPU, KV {mode} (output only)", "published": pub,
                     "simulated": r["tok_s_gpu"]})
    rows += kv_load_cap_rows(m, hw, prof)
    for row in rows:
        row["ratio"] = row["simulated"] / row["published"]
        print(f"{row['figure']:52s} published {row['published']:>10.4g}  simulated "
              f"{row['simulated']:>10.4g}  ratio {row['ratio']:.2f}")
    Path(args.out).write_text(json.dumps({"rows": rows, "profile_machine": prof.machine,
                                          "admission": prof.pd.get("admission"),
                                          "layout": dataclasses.asdict(Layout())}, indent=1))


if __name__ == "__main__":
    main()
