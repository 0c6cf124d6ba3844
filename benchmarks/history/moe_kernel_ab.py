"""Two or more revisions of the fused experts op (csrc/moe.cpp + csrc/gemm.h) in one process,
alternating, on the Qwen3-MoE benchmark shapes (BENCHMARKS.md, "Routed experts op: 2-thread
split and in-op epilogue").

Each revision's two files are taken from git (`--rev`, any commit-ish; `WORKTREE` is the files
on disk), its op library renamed so the copies load side by side, and built once into
/tmp/wideserve-moe-ab/. Weights are packed with this tree's wideserve.kernels.moe, so the
revisions must share the packed layout. Every call's output is checked bit-identical to the
first revision's. `--evict MB` touches that many MB between calls (weights then come from
DRAM, as in the engine, where attention's KV reads evict them).

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/history/moe_kernel_ab.py --rev 825e022 --rev WORKTREE
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from wideserve.kernels import moe as moe_op
from wideserve.kernels.loader import CFLAGS, LDFLAGS

SHAPES = {  # name: (experts, top-k, hidden, moe_intermediate)
    "qwen3moe-11m": (8, 2, 256, 256),
    "qwen3moe-653m": (64, 8, 1024, 384),
}
FILES = ("moe.cpp", "gemm.h")
ROOT = Path(__file__).resolve().parents[2]
CSRC = "wideserve/kernels/csrc"


def _source(rev: str, name: str) -> str:
    if rev == "WORKTREE":
        return (ROOT / CSRC / name).read_text()
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"],
                          check=True, capture_output=True, text=True).stdout


def load_revision(rev: str):
    """Builds `rev`'s op under its own library name; returns the op."""
    texts = {name: _source(rev, name) for name in FILES}
    digest = hashlib.sha256("\0".join(texts.values()).encode()).hexdigest()[:12]
    lib = f"moe_ab_{digest}"
    directory = Path("/tmp/wideserve-moe-ab") / lib
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(text.replace("(wideserve, ", f"({lib}, "))
    cpp_extension.load(name=lib, sources=[str(directory / "moe.cpp")],
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                       build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, lib).moe_fused_experts


def run(ops: dict, shape: str, tokens: int, rounds: int, evict_mb: int) -> dict[str, float]:
    E, k, d, inter = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, 2 * inter, d, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, d, inter, generator=g) * 0.05).bfloat16()
    w13p, w2p = moe_op.pack_experts(w1, w2)
    x = torch.randn(tokens, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    wts = torch.rand(tokens, k, generator=g)
    args = (x, ids, wts, w13p, w2p, inter, None, False, None, None)
    mac = tokens * k * 3 * d * inter
    calls = max(3, int(1e9 // mac))            # ~10 ms of work per round at ~100 GMAC/s
    evict = torch.zeros(evict_mb << 18) if evict_mb else None
    ref = None
    times: dict[str, list[float]] = {rev: [] for rev in ops}
    for _ in range(rounds):
        for rev, op in ops.items():            # alternate: noise hits every revision alike
            out = op(*args)
            if ref is None:
                ref = out
            elif not torch.equal(out, ref):
                raise SystemExit(f"{rev}: output differs from {next(iter(ops))}")
            total = 0.0
            for _ in range(calls):
                if evict is not None:
                    evict.add_(1.0)
                start = time.perf_counter()
                op(*args)
                total += time.perf_counter() - start
            times[rev].append(total / calls)
    return {rev: statistics.median(v) * 1e6 for rev, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", action="append", required=True,
                    help="a git commit-ish, or WORKTREE (repeat; the first is the reference)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="qwen3moe-11m:64,qwen3moe-11m:1,qwen3moe-11m:2048,"
                                        "qwen3moe-653m:16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--evict", type=int, default=0, help="MB touched between calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = {rev: load_revision(rev) for rev in args.rev}
    print(f"| shape | tokens | threads | evict MB | "
          + " | ".join(f"{r} (us)" for r in ops) + " | last / first |")
    print("|---|---|---|---|" + "---|" * len(ops) + "---|")
    for item in args.tokens.split(","):
        shape, tokens = item.split(":")
        us = run(ops, shape, int(tokens), args.rounds, args.evict)
        first, last = us[args.rev[0]], us[args.rev[-1]]
        print(f"| {shape} | {tokens} | {args.threads} | {args.evict} | "
              + " | ".join(f"{us[r]:.1f}" for r in ops) + f" | {last / first:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
