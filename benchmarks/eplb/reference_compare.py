"""Our EPLB policy against the reference algorithm on the same skewed synthetic loads.

The reference is deepseek-ai/EPLB's `eplb.py`, imported unmodified from a path you give
(`--reference-eplb`; e.g. a clone at d52c72d), and optionally vLLM's port of it
(`--vllm`, from an installed vllm). Both placements are scored by the same function
(`policy.rank_loads` + `policy.balancedness`), in-sample (the window the plan was computed
from) and held-out (a later, drifted window). Writes JSON; with `--write-test-data` also the
small file the policy test compares against (tests/parallel/eplb/data/reference_cases.json).

    python benchmarks/eplb/reference_compare.py --reference-eplb /path/to/EPLB/eplb.py \
        --out benchmarks/results/eplb_reference.json --write-test-data
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from wideserve.parallel.eplb import policy
from wideserve.parallel.eplb.synthetic import SkewedLoad, load_checksum

ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = ROOT / "tests/parallel/eplb/data/reference_cases.json"
# (experts, EP ranks, redundant, groups, nodes, skew, layers, tokens): the benchmarks.md
# grid (E=128/384, EP8..64, 0/32/64 redundant, global and hierarchical with 8 ranks a node),
# the bundled model's shape (8 experts, EP2/EP4) and a draft-like single layer.
GRID = [(e, r, red, g, n, s, 8, 32768)
        for e, s in ((128, 0.73), (384, 0.72))
        for r in (8, 16, 32, 64)
        for red in (0, 32, 64)
        for g, n in ((1, 1), (8, max(1, r // 8)))
        if (e + red) % r == 0 and not (n == 1 and g > 1)]
GRID += [(8, r, red, 1, 1, 1.0, 4, 4096) for r in (2, 4) for red in (0, 4)]
GRID += [(384, 32, 32, 1, 1, 0.72, 1, 8192), (384, 32, 32, 8, 4, 0.72, 1, 8192)]


def load_reference(path: str) -> Callable:
    spec = importlib.util.spec_from_file_location("deepseek_eplb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)          # type: ignore[union-attr]
    return module.rebalance_experts


def load_vllm() -> Callable:
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy  # noqa: PLC0415
    # vLLM's returns phy2log alone (deepseek-ai's a tuple of three).
    return lambda w, p, g, n, r: (DefaultEplbPolicy.rebalance_experts(w, p, g, n, r),)


def score(load: np.ndarray, phy2log: torch.Tensor, ranks: int) -> float:
    return policy.balancedness(policy.rank_loads(torch.from_numpy(load), phy2log.long(), ranks))


def run_case(case: tuple, refs: dict[str, Callable]) -> dict:
    e, r, red, g, n, skew, layers, tokens = case
    gen = SkewedLoad(layers=layers, experts=e, tokens=tokens, top_k=8, skew=skew)
    window, later = gen.window(), gen.held_out()
    slots = e + red
    row = {"experts": e, "ranks": r, "redundant": red, "groups": g, "nodes": n, "skew": skew,
           "layers": layers, "tokens": tokens, "load_sha": load_checksum(window),
           "policy": policy.choose_policy("auto", g, n)}
    ident = policy.identity_placement(layers, e, slots)
    row["identity"] = score(window, ident, r)
    t = time.perf_counter()
    ours = policy.rebalance(torch.from_numpy(window), slots, r, n, g)
    row["ours_s"] = time.perf_counter() - t
    row["ours"], row["ours_held_out"] = score(window, ours, r), score(later, ours, r)
    for name, fn in refs.items():
        t = time.perf_counter()
        phy2log = fn(torch.from_numpy(window).float(), slots, g, n, r)[0]
        row[f"{name}_s"] = time.perf_counter() - t
        row[name], row[f"{name}_held_out"] = score(window, phy2log, r), score(later, phy2log, r)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-eplb", required=True, help="path to deepseek-ai/EPLB eplb.py")
    ap.add_argument("--vllm", action="store_true", help="also run vllm.distributed.eplb")
    ap.add_argument("--out", default="benchmarks/results/eplb_reference.json")
    ap.add_argument("--write-test-data", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    refs = {"reference": load_reference(args.reference_eplb)}
    if args.vllm:
        refs["vllm"] = load_vllm()
    rows = []
    for case in GRID:
        rows.append(run_case(case, refs))
        x = rows[-1]
        print(f"E={x['experts']:3d} EP{x['ranks']:<2d} red={x['redundant']:2d} "
              f"{x['policy']:12s} L={x['layers']} ident {x['identity']:.3f}  ref "
              f"{x['reference']:.4f}/{x['reference_held_out']:.4f}  ours "
              f"{x['ours']:.4f}/{x['ours_held_out']:.4f}  t {x['ours_s']:.3f}s vs "
              f"{x['reference_s']:.3f}s", flush=True)
    describe = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
    meta = {"reference_eplb": args.reference_eplb, "git": describe,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cases": rows}, indent=1) + "\n")
    if args.write_test_data:
        keep = ("experts", "ranks", "redundant", "groups", "nodes", "skew", "layers", "tokens",
                "load_sha", "identity", "reference")
        TEST_DATA.parent.mkdir(parents=True, exist_ok=True)
        TEST_DATA.write_text(json.dumps(
            {"meta": {**meta, "produced_by": "benchmarks/eplb/reference_compare.py "
                                             "--write-test-data"},
             "cases": [{k: x[k] for k in keep} for x in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
