"""Engram host-table gathers on 2 MiB pages against 4 KiB pages (layers/engram.py HostTable,
kv_cache/host_memory.py huge_page_empty).

Two HostTables hold the same FP8 table (the official layout: e4m3 rows of 256 channels, one
UE8M0 scale per 32), one allocated on transparent huge pages, one on ordinary pages (the
checkpoint tensor as loaded). Each step gathers the rows of T tokens x 24 hashed ids at random
(what Engram's hashes look like to memory), timed alternately in one process; the median and
the 10th percentile are reported (on a shared, loaded machine the upper tail is preemption):
- rows: the raw row reads (index_select of the code bytes), what the page size changes;
- gather: HostTable.gather (rows + scales + dequantisation to fp32).
The huge-page table's AnonHugePages (from /proc/self/smaps) says how much the kernel backed.

  PYTHONPATH=. python benchmarks/v41_engram_table.py [--gib 1] [--reps 31]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from wideserve.kv_cache import host_memory
from wideserve.layers.engram import HostTable

DIM, IDS = 256, 24


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in out if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out if ln.startswith("Flags")), [])
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    return f"{model}; flags {isa}; load {os.getloadavg()[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="table size (code bytes)")
    ap.add_argument("--reps", type=int, default=201)
    ap.add_argument("--tokens", default="1,4,64,2048")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = int(args.gib * (1 << 30)) // DIM
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 126, (rows, DIM), dtype=torch.uint8, generator=g)
    codes = codes.view(torch.float8_e4m3fn)                 # finite e4m3 values only
    scale = torch.randint(110, 130, (rows, DIM // 32), dtype=torch.uint8,
                          generator=g).view(torch.float8_e8m0fnu)
    tables = {}
    for name, huge in (("huge", True), ("small", False)):
        t = HostTable(rows, DIM)
        t.huge_pages = huge
        t.load_fp8(codes, scale)
        tables[name] = t
    huge_bytes = host_memory.huge_page_bytes(tables["huge"].weight)
    print(f"# {machine()}; torch {torch.__version__}; 1 thread; THP "
          f"{host_memory.thp_mode()!r}; table {rows} x {DIM} FP8 "
          f"({rows * DIM / (1 << 30):.2f} GiB); huge-page table: "
          f"{huge_bytes / (1 << 20):.0f} MiB on AnonHugePages, ordinary table: "
          f"{host_memory.huge_page_bytes(tables['small'].weight) / (1 << 20):.0f} MiB")
    print("| tokens | rows read | rows 4K ms (p10) | rows 2M ms (p10) | speedup | "
          "gather 4K ms (p10) | gather 2M ms (p10) | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        ids = torch.randint(0, rows, (tokens, IDS), generator=g)
        assert torch.equal(tables["huge"].gather(ids), tables["small"].gather(ids))
        times = {(n, op): [] for n in tables for op in ("rows", "gather")}
        for _ in range(args.reps):
            fresh = torch.randint(0, rows, (tokens, IDS), generator=g)   # cold rows each rep
            for n, t in tables.items():
                flat = fresh.reshape(-1)
                t0 = time.perf_counter()
                t.weight.view(torch.uint8).index_select(0, flat)
                t1 = time.perf_counter()
                t.gather(fresh)
                t2 = time.perf_counter()
                times[(n, "rows")].append(t1 - t0)
                times[(n, "gather")].append(t2 - t1)
        ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
        p10 = {key: 1e3 * sorted(v)[len(v) // 10] for key, v in times.items()}

        def cell(key: tuple[str, str]) -> str:
            return f"{ms[key]:.3f} ({p10[key]:.3f})"
        print(f"| {tokens} | {tokens * IDS} | {cell(('small', 'rows'))} | "
              f"{cell(('huge', 'rows'))} | {ms[('small', 'rows')] / ms[('huge', 'rows')]:.2f}x"
              f" | {cell(('small', 'gather'))} | {cell(('huge', 'gather'))} | "
              f"{ms[('small', 'gather')] / ms[('huge', 'gather')]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
