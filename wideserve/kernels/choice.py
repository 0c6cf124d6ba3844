"""Which GEMM kernel runs, per machine, GEMM family and token-count bucket: chosen by timing
the candidates once on the machine in use (docs/cpu_kernels.md, "Kernel choice").

Candidates for a bf16 weight [N, K] on the CPU:
- "micro":  the extension's AVX512-BF16 micro-kernel (`gemm_linear`, csrc/gemm.h);
- "brgemm": torch's `at::native::cpublas::brgemm` (oneDNN's ukernel, AMX where present) over
            the same packed copy (csrc/brgemm.cpp), so micro and brgemm share one layout;
- "onednn": `torch.ops.mkldnn._linear_pointwise` on a weight packed once for oneDNN;
- "torch":  plain `F.linear` on the weight as loaded.
Families: "linear" (dense projections, the LM head), "qkv" (fused q/k/v and gate/up: the same
kernels, timed on their own shapes), "router" (the routing logits inside `moe_route`: micro or
brgemm), "experts" (the grouped expert GEMMs inside `moe_fused_experts`, timed on one
expert's shapes: micro or brgemm, the bucket being that expert's row count) and
"quant_experts" (the same for experts kept in a checkpoint's FP8 / MXFP4 / NVFP4 format,
`quant_grouped_linear`: its dot products or brgemm; the shape names the format too).
The two expert families are a row threshold in their ops (experts with at least that many
rows run brgemm): where the buckets switch to brgemm, the crossover inside the first brgemm
bucket is found by timing a few row counts in it (`KernelChoice.brgemm_from`), so that a
bucket timed at 16 rows does not send experts of 5 rows to the kernel that is faster at 16.

Each (family, N, K) shape is timed the first time a layer of that shape is prepared, at one row
count per bucket, and the fastest candidate per bucket is kept: the candidates called in
alternation, each one's median call compared, on the thread's CPU time at one torch thread (a
shared machine's other processes then cost nothing but cache), close calls timed again and
decided by the median timing (`KernelChoice._timed`); a kernel on a layout the pack
already holds is preferred where it is within `share_tolerance` of the fastest, so a weight is
held in one packed layout wherever that costs at most that much. Results are cached on disk
per machine (CPU model, ISA flags, torch version, thread count, kernel sources), so a second
start times nothing. `KernelPolicy.force` (env WIDESERVE_GEMM=micro|brgemm|onednn|torch|auto)
forces one kernel for A/B runs. The callables timed, and oneDNN's packed linear, are in
kernels/candidates.py.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection

import torch
import torch.nn.functional as F

from wideserve.kernels import gemm
from wideserve.kernels import sdpa_context
from wideserve.kernels.candidates import (Pools, candidate, evict_caches, packed_linear,
                                          prepack, reads_cold)
from wideserve.kernels.loader import CSRC, cpu_ops_available
from wideserve.kernels.timing import clock_of, time_interleaved
from wideserve.utils.cpu_id import cpu_id

logger = logging.getLogger(__name__)

FAMILIES = ("linear", "qkv", "router", "experts", "quant_experts", "attention",
            "attention_ctx")
KERNELS = ("micro", "brgemm", "onednn", "torch")
ATTENTION_KERNELS = ("own", "sdpa", "flash")
FAMILY_KERNELS = {"linear": KERNELS, "qkv": KERNELS, "router": ("micro", "brgemm"),
                  "experts": ("micro", "brgemm"), "quant_experts": ("micro", "brgemm"),
                  "attention": ATTENTION_KERNELS,
                  "attention_ctx": ATTENTION_KERNELS}
# Token-count buckets (inclusive bounds; None: no upper bound) and the row count each is timed at.
BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, None))
SAMPLE_ROWS = (1, 4, 16, 64, 256, 512)
LAYOUT = {"micro": "panel", "brgemm": "panel", "onednn": "onednn", "torch": "plain",
          "own": "-", "sdpa": "-", "flash": "-"}
# Kernels whose per-row result does not depend on the rows beside it (no M-dependent algorithm
# or K split; tests/kernels/test_batch_invariant_kernels.py checks it over M = 1..300): the only
# candidates of KernelConfig.batch_invariant, one kernel for every bucket (`plan(invariant=)`).
INVARIANT_KERNELS = ("micro", "brgemm")
ENV_FORCE = "WIDESERVE_GEMM"
ENV_CACHE = "WIDESERVE_KERNEL_CHOICE_CACHE"
# Families whose op runs brgemm from a row count on (`brgemm_from`), refined within a bucket.
THRESHOLD_FAMILIES = ("experts", "quant_experts")
FORMAT = 5                     # bump when the table's meaning changes (3: cold decode rows;
                               # 4: the expert families' crossover rows; 5: those narrowed
                               # to KernelPolicy.crossover_resolution)


def bucket_of(rows: int) -> int:
    """Index into BUCKETS of a GEMM with `rows` rows (0 rows: the first)."""
    return 0 if rows <= 1 else 1 if rows <= 4 else 2 if rows <= 16 else \
        3 if rows <= 64 else 4 if rows <= 256 else 5


def bucket_label(i: int) -> str:
    lo, hi = BUCKETS[i]
    return f">{lo - 1}" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this build packs and runs oneDNN linear weights of `dtype` (bf16 only: fp32
    runs MKL's GEMM, which needs no re-layout) - a tiny probe checked against F.linear."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 32, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        return bool(torch.equal(packed_linear(x, prepack(w)), F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def brgemm_runs() -> bool:
    """Whether torch's bf16 brgemm runs on this CPU (and matches the micro-kernel's result to
    a rounding on a probe)."""
    if not cpu_ops_available() or not torch.ops.wideserve.brgemm_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(40, 64, generator=g).bfloat16()
        x = torch.randn(5, 64, generator=g).bfloat16()
        got = gemm.linear_brgemm(x, gemm.pack_linear(w), 40)
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except RuntimeError:
        return False


# --- the policy (a config object) and the machine key ---

def _default_cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "wideserve" /
                "kernel_choice")


@dataclass(frozen=True)
class KernelPolicy:
    """How kernels are chosen. `force`: one of KERNELS (where it can run) or "auto"
    (measured); `cache_dir` None: no disk cache."""

    force: str = "auto"
    cache_dir: Path | None = field(default_factory=_default_cache_dir)
    share_tolerance: float = 0.05   # a kernel on an already-held layout within this of best
    prune_ratio: float = 4.0        # this much slower, and growing with the rows: not timed
                                    # at larger buckets
    crossover_steps: int = 6        # at most this many timings narrow an expert family's
                                    # brgemm threshold, ...
    crossover_resolution: float = 1 / 16   # ... until the rows it may lie in are at most
                                    # this fraction of the rows below it (one row at least)
    min_time_s: float = 1e-2        # per bucket: alternate all candidates at least this long
    min_reps: int = 5               # ... and at least this many rounds ...
    max_reps: int = 30              # ... but at most this many (the median of the rounds kept)
    recheck_margin: float = 0.15    # candidates this close to the fastest are timed again ...
    rechecks: int = 2               # ... this many more times (the median of all timings)
    clock: str = "auto"             # "cpu": the thread's CPU time, "wall", "auto": cpu at 1
                                    # thread (immune to other processes' time slices)
    max_cols: int = 2048            # wider outputs (an LM head) are timed on a slice

    def __post_init__(self) -> None:
        if self.force not in KERNELS + ("auto",):
            raise ValueError(f"{ENV_FORCE}={self.force!r}: choose one of auto, "
                             f"{', '.join(KERNELS)}")
        if self.clock not in ("auto", "cpu", "wall"):
            raise ValueError(f"KernelPolicy.clock={self.clock!r}: choose auto, cpu or wall")

    @classmethod
    def from_env(cls) -> KernelPolicy:
        return cls(force=os.environ.get(ENV_FORCE, "auto").strip().lower() or "auto")


def machine_key() -> dict:
    """What a measured table depends on besides the shapes: the CPU by name and by family /
    model / stepping (a Zen 4 and a Zen 5 guest both read "AMD EPYC"), its vector and matrix
    flags, torch, the threads and the kernels' sources."""
    cpu = cpu_id()
    flags = sorted(f for f in cpu.flags if f.startswith(("avx", "amx", "fma")))
    sources = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cpp", ".h"):
            sources.update(path.name.encode() + path.read_bytes())
    return {"format": FORMAT, "cpu": cpu.label(), "isa": flags, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "sources": sources.hexdigest()[:16]}


# --- the table ---

@dataclass
class Entry:
    """One (family, shape): the kernel per bucket and the measured microseconds per candidate
    (None: not timed - pruned - or not runnable)."""

    kernels: list[str]
    times_us: list[dict[str, float | None]]
    forced: bool = False
    # THRESHOLD_FAMILIES: the fewest rows brgemm runs at (None: never), and the rows timed
    # inside the crossover bucket to find it -> us per candidate
    brgemm_rows: int | None = None
    crossover_us: dict[int, dict[str, float]] = field(default_factory=dict)


# (family, kernels, shape, rows) -> seconds per kernel (one bucket's candidates together);
# shape: (N, K) of a GEMM family, (heads, kv heads, head dim) of "attention"
Timer = Callable[[str, tuple[str, ...], tuple[int, ...], int], dict[str, float]]


class KernelChoice:
    """The measured kernel table of this process and the policy that fills it."""

    def __init__(self, policy: KernelPolicy | None = None, timer: Timer | None = None) -> None:
        self.policy = policy or KernelPolicy.from_env()
        self._timer = timer or self._time
        self._pools: Pools | None = None    # while a shape is measured (_measure)
        self._lock = threading.Lock()
        self._tables: dict[int, dict[str, Entry]] = {}     # threads -> key -> entry
        self._loaded: set[int] = set()

    # -- what can run

    def runnable(self, family: str, dtype: torch.dtype) -> tuple[str, ...]:
        """The candidates of `family` that can run here for `dtype` weights."""
        if family.startswith("attention"):
            if dtype != torch.bfloat16 or not cpu_ops_available():
                return ()
            return ATTENTION_KERNELS if sdpa_context.flash_compiled() else ("own", "sdpa")
        if dtype != torch.bfloat16:
            return ("torch",) if family in ("linear", "qkv") else ()
        ok = {"micro": gemm.fast_path_compiled(), "brgemm": brgemm_runs(),
              "onednn": onednn_runs(dtype), "torch": True}
        return tuple(k for k in FAMILY_KERNELS[family] if ok[k])

    # -- the plan of one shape

    def plan(self, family: str, n: int, k: int, dtype: torch.dtype,
             allowed: tuple[str, ...] | None = None,
             invariant: bool = False, extra: tuple[int, ...] = ()) -> tuple[str, ...]:
        """The kernel per bucket for a [n, k] weight of `family` ('' where none can run).
        invariant (KernelConfig.batch_invariant): one row-invariant kernel for every bucket.
        extra: the rest of the shape where a family needs more than (n, k) ("quant_experts":
        candidates.quant_shape's format fields)."""
        cands = tuple(c for c in self.runnable(family, dtype)
                      if (allowed is None or c in allowed)
                      and (not invariant or c in INVARIANT_KERNELS))
        if not cands:
            return ("",) * len(BUCKETS)
        force = self.policy.force
        if invariant:
            return (self._invariant_pick(family, (n, k) + extra, cands),) * len(BUCKETS)
        if force != "auto":
            pick = force if force in cands else cands[-1] if "torch" in cands else cands[0]
            return (pick,) * len(BUCKETS)
        if len(cands) == 1:
            return cands * len(BUCKETS)
        entry = self.entry(family, (n, k) + extra, cands)
        return tuple(entry.kernels)

    def brgemm_from(self, family: str, n: int, k: int, dtype: torch.dtype,
                    invariant: bool = False, extra: tuple[int, ...] = ()) -> int | None:
        """An expert family's plan as its op's threshold: the fewest rows an expert runs
        brgemm at (None: never) - the measured crossover where the plan was timed, else
        (forced, one candidate, the batch-invariant mode's one kernel) the plan's bound."""
        plan = self.plan(family, n, k, dtype, invariant=invariant, extra=extra)
        cands = self.runnable(family, dtype)
        if invariant or self.policy.force != "auto" or len(cands) < 2:
            return brgemm_min_rows(plan)
        return self.entry(family, (n, k) + extra, cands).brgemm_rows

    def _invariant_pick(self, family: str, shape: tuple[int, ...],
                        cands: tuple[str, ...]) -> str:
        """The forced kernel where it is a candidate, else the one with the least summed time
        relative to the best per bucket (pruned: never best)."""
        if self.policy.force in cands or len(cands) == 1:
            return self.policy.force if self.policy.force in cands else cands[0]
        times = self.entry(family, shape, cands).times_us
        best = [min(t for t in row.values() if t is not None) for row in times]
        return min(cands, key=lambda c: sum(float("inf") if row.get(c) is None else
                                            row[c] / b for row, b in zip(times, best)))

    def plan_attention(self, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, context: bool = False) -> tuple[str, ...]:
        """"own" (the C++ paged op), "sdpa" (torch's fused attention) or "flash" (the
        extension's flash kernel, where it takes heads of `head_dim`) per bucket of query
        tokens per request: for a fresh prefill (SDPA on the step's own k/v), or with
        `context` for a chunk attending to as many cached positions as it has queries
        (family "attention_ctx": SDPA on the context gathered from the cache,
        kernels/sdpa_context.py)."""
        family = "attention_ctx" if context else "attention"
        cands = tuple(c for c in self.runnable(family, dtype)
                      if c != "flash" or sdpa_context.flash_fits(head_dim))
        if self.policy.force != "auto" or len(cands) < 2:
            return (cands[0] if cands else "",) * len(BUCKETS)
        return tuple(self.entry(family, (heads, kv_heads, head_dim), cands).kernels)

    def entry(self, family: str, shape: tuple[int, ...], cands: tuple[str, ...]) -> Entry:
        threads = torch.get_num_threads()
        key = f"{family}:{'x'.join(map(str, shape))}:{'+'.join(cands)}"
        with self._lock:
            table = self._table(threads)
            if key not in table:
                start = time.perf_counter()
                table[key] = self._measure(family, shape, cands)
                logger.info("kernel choice %s %s (%d threads, timed in %.2f s): %s",
                            family, "x".join(map(str, shape)), threads,
                            time.perf_counter() - start,
                            ", ".join(f"{bucket_label(i)}: {kern}"
                                      for i, kern in enumerate(table[key].kernels)))
                self._save(threads)
            return table[key]

    def _measure(self, family: str, shape: tuple[int, ...], cands: tuple[str, ...]) -> Entry:
        self._pools = Pools()           # the shape's weight copies, for all its buckets
        try:
            return self._measure_buckets(family, shape, cands)
        finally:
            self._pools = None

    def _measure_buckets(self, family: str, shape: tuple[int, ...],
                         cands: tuple[str, ...]) -> Entry:
        times: list[dict[str, float | None]] = []
        alive = set(cands)
        prev: dict[str, float | None] = {}
        for i, rows in enumerate(SAMPLE_ROWS):
            timed_now = self._timed(family, tuple(c for c in cands if c in alive), shape, rows)
            row: dict[str, float | None] = {c: timed_now.get(c) for c in cands}
            times.append({c: (None if t is None else t * 1e6) for c, t in row.items()})
            timed = [t for t in row.values() if t is not None]
            if timed and i:
                # A candidate far behind whose time already grows with the rows (compute-
                # bound, not a fixed cost that larger calls amortise) cannot catch up.
                grow = 0.5 * rows / SAMPLE_ROWS[i - 1]
                best = min(timed)
                alive -= {c for c, t in row.items()
                          if t is not None and t > self.policy.prune_ratio * best
                          and prev.get(c) and t >= grow * prev[c]}
            prev = row
        entry = Entry(choose(times, self.policy.share_tolerance), times)
        if family in THRESHOLD_FAMILIES:
            entry.brgemm_rows = self._crossover(family, shape, entry)
        return entry

    def _crossover(self, family: str, shape: tuple[int, ...], entry: Entry) -> int | None:
        """The fewest rows from which brgemm runs: the plan's first brgemm bucket of the run
        that goes to the top, narrowed down inside it by bisection between the rows timed
        below it (the other kernel faster) and the rows it was timed at (brgemm faster),
        until at most `policy.crossover_resolution` of the lower rows are left between them
        or after `policy.crossover_steps` timings; the timings go to `entry.crossover_us`.
        Three fixed timings left 24 rows of the 65-256 bucket undecided: on the 11M model's
        experts the threshold came out at 88 rows where brgemm was already 8-14% faster
        from 67 (Zen 5, BENCHMARKS.md "Zen 5: the goals per run")."""
        start = brgemm_min_rows(tuple(entry.kernels))
        if start is None or start == 1:
            return start
        i = bucket_of(start)
        other = entry.kernels[i - 1]
        lo, hi = SAMPLE_ROWS[i - 1], SAMPLE_ROWS[i]
        for _ in range(self.policy.crossover_steps):
            if hi - lo <= max(1, int(lo * self.policy.crossover_resolution)):
                break
            mid = (lo + hi) // 2
            t = self._timed(family, (other, "brgemm"), shape, mid)
            entry.crossover_us[mid] = {c: v * 1e6 for c, v in t.items()}
            if t["brgemm"] < t[other]:
                hi = mid
            else:
                lo = mid
        return hi

    def _timed(self, family: str, kernels: tuple[str, ...], shape: tuple[int, ...],
               rows: int) -> dict[str, float]:
        """One bucket's seconds per kernel. Close calls decide the bucket, and one timing of
        a shared machine can flip them: the candidates within `recheck_margin` of the fastest
        are timed again together, up to `rechecks` times, and each kernel's median timing
        kept (a lone outlier timing then decides nothing)."""
        runs = {c: [t] for c, t in self._timer(family, kernels, shape, rows).items()}
        for _ in range(self.policy.rechecks):
            now = {c: statistics.median(v) for c, v in runs.items()}
            best = min(now.values(), default=0.0)
            close = tuple(c for c in kernels if c in now
                          and now[c] <= (1 + self.policy.recheck_margin) * best)
            if len(close) < 2:
                break
            for c, t in self._timer(family, close, shape, rows).items():
                runs[c].append(t)
        return {c: statistics.median(v) for c, v in runs.items()}

    # -- timing one candidate

    def _time(self, family: str, kernels: tuple[str, ...], shape: tuple[int, ...],
              rows: int) -> dict[str, float]:
        """The median of several calls of each kernel, the kernels called in alternation
        and in a rotating order (a burst of load from elsewhere, or the cache state the
        previous call left, then hits all of them alike)."""
        if not family.startswith("attention"):
            shape = (min(shape[0], self.policy.max_cols),) + shape[1:]
        fns = {c: candidate(family, c, shape, rows, self._pools) for c in kernels}
        if reads_cold(family, rows):
            evict_caches()                 # the copies just built: out of the caches
        samples = time_interleaved(fns, self.policy.min_reps, self.policy.max_reps,
                                   self.policy.min_time_s, self.policy.clock)
        return {c: statistics.median(v) for c, v in samples.items()}

    # -- disk cache

    def _path(self, threads: int) -> Path | None:
        if self.policy.cache_dir is None:
            return None
        key = machine_key()
        key["threads"] = threads
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.policy.cache_dir / f"{digest}.json"

    def _table(self, threads: int) -> dict[str, Entry]:
        table = self._tables.setdefault(threads, {})
        if threads not in self._loaded:
            self._loaded.add(threads)
            path = self._path(threads)
            if path is not None and path.is_file():
                try:
                    data = json.loads(path.read_text())
                    for key, e in data.get("entries", {}).items():
                        table.setdefault(key, Entry(
                            list(e["kernels"]), list(e["times_us"]),
                            brgemm_rows=e.get("brgemm_rows"),
                            crossover_us={int(r): t for r, t in
                                          e.get("crossover_us", {}).items()}))
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    logger.warning("kernel choice cache %s unreadable (%s): re-timing", path,
                                   exc)
        return table

    def _save(self, threads: int) -> None:
        path = self._path(threads)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            body = {"key": {**machine_key(), "threads": threads},
                    "entries": {key: dataclasses.asdict(e)
                                for key, e in self._tables[threads].items()}}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1))
            tmp.replace(path)                  # atomic: a reader never sees half a file
        except OSError as exc:
            logger.warning("kernel choice cache %s not written: %s", path, exc)

    # -- reporting

    def table(self, threads: int | None = None) -> list[dict]:
        """The measured table for `threads` (default: torch's count now): one row per
        (family, shape) with the kernel and the times (us) of every candidate per bucket."""
        threads = torch.get_num_threads() if threads is None else threads
        with self._lock:
            entries = dict(self._table(threads))
        rows = []
        for key, e in sorted(entries.items()):
            family, shape, _ = key.split(":")
            rows.append({"family": family, "shape": shape, "threads": threads,
                         "buckets": [{"rows": bucket_label(i), "kernel": e.kernels[i],
                                      "times_us": e.times_us[i]}
                                     for i in range(len(BUCKETS))],
                         **({"brgemm_rows": e.brgemm_rows, "crossover_us": e.crossover_us}
                            if family in THRESHOLD_FAMILIES else {})})
        return rows

    def describe(self, threads: int | None = None) -> list[str]:
        """The table as text lines (`wideserve info`, the startup log)."""
        lines = [f"GEMM kernel choice (policy {self.policy.force}, "
                 f"{torch.get_num_threads() if threads is None else threads} threads; "
                 f"rows per call: kernel, its us / the best other candidate's us)"]
        for row in self.table(threads):
            cells = []
            for b in row["buckets"]:
                times = {k: v for k, v in b["times_us"].items() if v is not None}
                mine = times.get(b["kernel"])
                others = [v for k, v in times.items() if k != b["kernel"]]
                cells.append(f"{b['rows']}: {b['kernel']}" + (
                    "" if mine is None else f" {mine:.0f}" if not others else
                    f" {mine:.0f}/{min(others):.0f}"))
            lines.append(f"  {row['family']:8s} {row['shape']:>11s}  " + "; ".join(cells)
                         + _threshold_note(row))
        return lines


    def summary(self, shapes: Collection[tuple[str, str]] | None = None,
                threads: int | None = None) -> list[str]:
        """The table in a few lines (the startup block): per (family, shape) the kernel of
        each run of token buckets and the chosen kernel's measured us per bucket. `shapes`:
        only these (family, "NxK") - one model's; `threads` default: torch's count now."""
        threads = torch.get_num_threads() if threads is None else threads
        if self.policy.force != "auto":
            return [f"GEMM kernel {self.policy.force} for every family and token count "
                    f"({ENV_FORCE}={self.policy.force}; nothing measured)"]
        rows = [r for r in self.table(threads)
                if shapes is None or (r["family"], r["shape"]) in shapes]
        if not rows:
            return [f"GEMM kernel choice: no shape measured at {threads} threads"]
        lines = [f"GEMM kernel per token bucket ({threads} thread{'s' * (threads != 1)}; the "
                 f"kernel's us at {'/'.join(map(str, SAMPLE_ROWS))} rows; every candidate's: "
                 f"wideserve info --kernels)"]
        for row in rows:
            runs: list[list] = []                  # [kernel, first bucket, last bucket]
            for i, b in enumerate(row["buckets"]):
                if runs and runs[-1][0] == b["kernel"]:
                    runs[-1][2] = i
                else:
                    runs.append([b["kernel"], i, i])
            kernels = ", ".join(f"{k} {_span(first, last)}" for k, first, last in runs)
            us = " ".join("-" if b["times_us"].get(b["kernel"]) is None
                          else f"{b['times_us'][b['kernel']]:.0f}" for b in row["buckets"])
            lines.append(f"  {row['family']:9s} {row['shape']:>11s}  {kernels}  ({us} us)"
                         + _threshold_note(row))
        return lines


def _threshold_note(row: dict) -> str:
    """An expert family's measured threshold, where the buckets alone do not say it."""
    rows = row.get("brgemm_rows")
    if rows is None or rows == 1 or not row.get("crossover_us"):
        return ""
    return f"  [brgemm from {rows} rows]"


def _span(first: int, last: int) -> str:
    """Token buckets first..last as one range: "1", "2-16", "17+"."""
    lo, hi = BUCKETS[first][0], BUCKETS[last][1]
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


def choose(times: list[dict[str, float | None]], tolerance: float) -> list[str]:
    """The kernel per bucket from measured times: the fastest, except that where one packed
    layout can serve every bucket within `tolerance` of the fastest, that layout's kernels
    run (one copy of the weight instead of two)."""
    fastest = []
    for row in times:
        timed = {k: t for k, t in row.items() if t is not None}
        fastest.append(min(timed, key=timed.get) if timed else next(iter(row)))
    if len({LAYOUT[k] for k in fastest}) == 1:
        return fastest
    best_single: tuple[float, list[str]] | None = None
    for layout in dict.fromkeys(LAYOUT[k] for k in fastest):
        picks, total = [], 0.0
        for row, win in zip(times, fastest):
            same = {k: t for k, t in row.items() if t is not None and LAYOUT[k] == layout}
            if not same or row[win] is None:
                break
            k = min(same, key=same.get)
            if same[k] > (1 + tolerance) * row[win]:
                break
            picks.append(k)
            total += same[k] / row[win]
        else:
            if best_single is None or total < best_single[0]:
                best_single = (total, picks)
    return fastest if best_single is None else best_single[1]


def brgemm_min_rows(plan: tuple[str, ...]) -> int | None:
    """The experts family's plan as the fused op's threshold: the lower bound of the first
    bucket from which every larger bucket picks brgemm (None: none)."""
    start = None
    for i in range(len(plan) - 1, -1, -1):
        if plan[i] != "brgemm":
            break
        start = i
    return None if start is None else BUCKETS[start][0]


@functools.cache
def default_choice() -> KernelChoice:
    """The process's table, under the policy from the environment (layers/linear.py and
    layers/experts.py use it unless handed another)."""
    return KernelChoice(KernelPolicy.from_env())
