"""Bins the rounds of benchmarks/expert_prefetch_probe.cpp by the bandwidth each round read
(its "read" figure) and prints each variant's median GB/s per bin.

  python benchmarks/expert_prefetch_probe.py probe.txt [--edges 40 50]
"""
from __future__ import annotations

import argparse
import re
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--edges", type=float, nargs="*", default=[40.0, 50.0],
                    help="bin edges in GB/s of the round's plain read")
    a = ap.parse_args()
    rounds = []
    for line in open(a.file):
        pairs = re.findall(r"(\S+) (\d+(?:\.\d+)?)", line)
        if pairs and pairs[0][0] == "read":
            rounds.append({k: float(v) for k, v in pairs})
    edges = [0.0] + sorted(a.edges) + [float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in rounds if lo <= r["read"] < hi]
        if not sel:
            continue
        print(f"read {lo:g}-{hi:g} GB/s, {len(sel)} rounds:")
        for k in sel[0]:
            print(f"  {k:14s} {statistics.median(r[k] for r in sel):6.1f}")


if __name__ == "__main__":
    main()
