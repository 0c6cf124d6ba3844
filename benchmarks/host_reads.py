"""Host reads of the device per decode step, per model family: the "before" table of issue 28's
sync-free decode step (docs/testing.md, "Counting host reads").

On a GPU every read of a device tensor by the host (`Tensor.item`, `tolist`, `cpu`, `numpy`,
`__array__`, `__bool__` / `__int__` / `__float__` / `__index__`, `nonzero`) waits for the
launch queue to drain. Here, on the CPU, `HostReadCounter` wraps those entry points on
`torch.Tensor` and counts calls:
- in the decode forward: while the model's `forward` runs (wrapped on the instance);
- in the whole step: everything `llm.generate` does per decode step (schedule, forward,
  sample, output).
Per decode step = (count for 2 + N tokens - count for 2 tokens) / N, so prefill and startup
cancel out. The CPU cannot tell a device tensor from a host-built metadata tensor, and the CPU
takes its own kernels' paths, so these are upper bounds on what CUDA would sync on; they are a
baseline to compare against, not a GPU measurement. The models are not changed.

  PYTHONPATH=. python benchmarks/host_reads.py [--families v4,v41,qwen3moe] [--tokens 8]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__",
         "__index__", "nonzero")


class HostReadCounter:
    """Counts calls of the host-read entry points of torch.Tensor while active; `scope`
    splits them into those inside a named region (e.g. the forward) and all of them."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()         # "entry file:line" of each read
        self._depth = 0
        self._reading = False
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, original):
        counter = self

        def wrapper(self_tensor, *args, **kwargs):
            if counter._reading:          # one read implemented by another (__array__ ->
                return original(self_tensor, *args, **kwargs)   # numpy) counts once
            counter.total[name] += 1
            if counter._depth:
                counter.inside[name] += 1
            caller = sys._getframe(1)
            counter.sites[f"{name} {Path(caller.f_code.co_filename).name}:"
                          f"{caller.f_lineno}"] += 1
            counter._reading = True
            try:
                return original(self_tensor, *args, **kwargs)
            finally:
                counter._reading = False
        return wrapper

    def __enter__(self) -> HostReadCounter:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    @contextlib.contextmanager
    def scope(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Count reads inside `module.forward` (an instance attribute: the class and the
        other instances are untouched)."""
        forward = module.forward

        def counted(*args, **kwargs):
            with self.scope():
                return forward(*args, **kwargs)
        module.forward = counted


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
    path = check.model_dir(family, tmp)
    vocab = json.loads((path / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = check.make_llm(path, "cpu", "float32", True, max(batch, 1))
    prompts = check.prompts(batch, 16, vocab)
    counts = {}
    paths = _force_cuda_paths(llm.engine.model) if cuda_paths else contextlib.nullcontext()
    with paths:
        for n in (2, 2 + tokens):
            with HostReadCounter() as c:
                c.wrap_forward(llm.engine.model)
                check.greedy(llm, prompts, n)
                del llm.engine.model.forward          # back to the class's forward
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
    p.add_argument("--families", default="v4,v41,qwen3moe")
    p.add_argument("--tokens", type=int, default=8, help="decode steps counted")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", action="store_true", help="also print one JSON line per family")
    p.add_argument("--cuda-paths", action="store_true",
                   help="also count with the CUDA code paths forced on the CPU "
                        "(tests/cuda_paths.py)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
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
