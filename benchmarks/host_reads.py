"""Host reads of the device per decode step, per model family: the before / after table of issue
28's sync-free decode step (docs/testing.md, "Counting host reads"; docs/host_path.md, "The
host-read budget").

On a GPU every read of a device tensor by the host (`Tensor.item`, `tolist`, `cpu`, `numpy`,
`__array__`, `__bool__` / `__int__` / `__float__` / `__index__`, `nonzero`) waits for the
launch queue to drain. Here, on the CPU, `HostReadCounter` (tests/host_read_counter.py) wraps
those entry points on `torch.Tensor` and counts calls:
- in the decode forward: while the model's `forward` runs (wrapped on the instance);
- in the whole step: everything `llm.generate` does per decode step (schedule, forward,
  sample, output).
Per decode step = (count for 2 + N tokens - count for 2 tokens) / N, so prefill and startup
cancel out. `--dep2` adds DEP2 with EPLB recording (two spawned DPEngineCore ranks of tiny
Qwen3-MoE, rank 0's reads over N decode steps), over the EP exchange's exact path (what every
step took before) and the padded one. The CPU cannot tell a device tensor from a host-built
metadata tensor, and the CPU takes its own kernels' paths, so these are upper bounds on what
CUDA would sync on, not a GPU measurement. Models: tests/tiny_families.py.

  PYTHONPATH=. python benchmarks/host_reads.py [--families v4,v41,qwen3moe,llama] [--tokens 8]
        [--cuda-paths] [--dep2]
"""
from __future__ import annotations

import argparse
import importlib.util
import contextlib
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from host_read_counter import READS, HostReadCounter  # noqa: E402
from tiny_families import FAMILIES, model_dir, vocab_size  # noqa: E402

__all__ = ["HostReadCounter", "READS", "reads_per_step", "dep2_reads", "table"]


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)
    spec.loader.exec_module(mod)
    return mod


def _force_cuda_paths(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """tests/cuda_paths.py's switch to the paths the model takes on CUDA (plain torch ops,
    grouped_mm experts, static attention), undone on exit."""
    import pytest
    sys.path.insert(0, str(ROOT))
    from tests.cuda_paths import force_cuda_paths
    mp = pytest.MonkeyPatch()
    try:
        force_cuda_paths(mp, model)
    except Exception:
        mp.undo()                  # a half-applied switch must not leak into the next family
        raise
    return contextlib.closing(type("Undo", (), {"close": lambda self: mp.undo()})())


def reads_per_step(family: str, tokens: int, batch: int, tmp: Path,
                   cuda_paths: bool = False) -> dict:
    check = _check_module()
    path = model_dir(family, tmp)
    vocab = vocab_size(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = check.make_llm(path, "cpu", "float32", True, max(batch, 1))
    prompts = check.prompts(batch, 16, vocab)
    counts = {}
    paths = _force_cuda_paths(llm.engine.model) if cuda_paths else contextlib.nullcontext()
    with paths:
        for n in (2, 2 + tokens):
            with HostReadCounter() as c:
                undo = c.wrap_forward(llm.engine.model)
                check.greedy(llm, prompts, n)
                undo()                                # back to the class's forward
            counts[n] = c
    lo, hi = counts[2], counts[2 + tokens]

    def per(a: Counter, b: Counter) -> dict[str, float]:
        return {k: round((a[k] - b[k]) / tokens, 2) for k in READS if a[k] - b[k]}
    return {"family": family + (" (CUDA paths)" if cuda_paths else ""), "batch": batch,
            "forward": per(hi.inside, lo.inside), "step": per(hi.total, lo.total),
            "sites": {k: round((hi.sites[k] - lo.sites[k]) / tokens, 2)
                      for k in hi.sites if hi.sites[k] - lo.sites[k]},
            "forward_total": round((sum(hi.inside.values()) - sum(lo.inside.values())) / tokens, 2),
            "step_total": round((sum(hi.total.values()) - sum(lo.total.values())) / tokens, 2)}


def _dep2_rank(rank: int, world: int, port: int, tmp: str, padded: bool, steps: int) -> dict:
    """One DEP2 rank (DPEngineCore, EP dispatch, EPLB recording) of tiny Qwen3-MoE: reads per
    decode step in its forward and in its step + finish_step + EPLB step (the DP sync's host
    rows not counted). padded False: the EP exchange's exact path, what every step took
    before the padded one (layers/ep_dispatch.py)."""
    from test_host_read_budget import EPLB, _add, _engine_kwargs
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.dp_engine import DPEngineCore
    path = model_dir("qwen3moe", Path(tmp) / f"rank{rank}")
    config = engine_config_from_kwargs(**_engine_kwargs(
        path, data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
        enable_expert_parallel=True, dp_sync_timeout_s=60, enable_eplb=True, eplb_config=EPLB))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = DPEngineCore(config)
    if not padded:
        core.dispatcher.padded = None
        core.runner.step_sync = None
    try:
        _add(core, path, 2, 2 + steps, seed=rank)
        core.dp_step(False)                                   # the prefill
        with HostReadCounter() as c:
            undo = [c.wrap_forward(core.model)] + [
                c.wrap(o, m, "step") for o, m in [(core, "step"), (core, "_dummy_step"),
                                                  (core.dispatcher, "finish_step"),
                                                  (core.eplb, "step")]]
            for _ in range(steps):
                core.dp_step(False)
            for u in undo:
                u()
        return {"forward": c.reads("inside") / steps, "step": c.reads("step") / steps,
                "sites": {k: v / steps for k, v in c.sites.items()}}
    finally:
        core.dp_step(True)
        core.group.destroy()


def dep2_reads(padded: bool, steps: int, tmp: Path) -> dict:
    """Rank 0's reads per decode step under DEP2 with EPLB recording (tiny Qwen3-MoE)."""
    from dist_utils import free_port_block, run_ranks
    r = run_ranks(_dep2_rank, 2, (2, free_port_block(4), str(tmp), padded, steps),
                  timeout_s=300)[0]
    label = "padded EP exchange (after)" if padded else "exact EP exchange (before)"
    return {"family": f"qwen3moe DEP2+EPLB, {label}", "batch": 2,
            "forward_total": round(r["forward"], 2), "step_total": round(r["step"], 2),
            "sites": {k: round(v, 2) for k, v in r["sites"].items()}}


def table(rows: list[dict]) -> str:
    lines = ["| family | batch | reads / decode forward | reads / whole decode step | where "
             "(entry file:line, per step) |", "|---|---|---|---|---|"]
    for r in rows:
        entries = ", ".join(f"{k} {v:g}" for k, v in sorted(r["sites"].items(),
                                                         key=lambda kv: -kv[1]))
        lines.append(f"| {r['family']} | {r['batch']} | {r['forward_total']:g} | "
                     f"{r['step_total']:g} | {entries} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--tokens", type=int, default=8, help="decode steps counted")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", action="store_true", help="also print one JSON line per family")
    p.add_argument("--cuda-paths", action="store_true",
                   help="also count with the CUDA code paths forced on the CPU "
                        "(tests/cuda_paths.py)")
    p.add_argument("--dep2", action="store_true",
                   help="also count DEP2 with EPLB recording (tiny Qwen3-MoE, rank 0), over "
                        "the exact EP exchange (before) and the padded one (after)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for padded in (False, True) if args.dep2 else ():
            rows.append(dep2_reads(padded, args.tokens, Path(tmp) / f"dep2-{padded}"))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
        for family in args.families.split(","):
            for cuda_paths in (False, True) if args.cuda_paths else (False,):
                try:
                    rows.append(reads_per_step(family, args.tokens, args.batch, Path(tmp),
                                               cuda_paths))
                except Exception as e:  # noqa: BLE001 - a family without such a path
                    print(f"{family} cuda_paths={cuda_paths}: {type(e).__name__}: {e}",
                          file=sys.stderr)
                    continue
                if args.json:
                    print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
