"""Counting host reads of the device (docs/testing.md, "Counting host reads").

On a GPU every read of a device tensor by the host (`Tensor.item`, `tolist`, `cpu`, `numpy`,
`__array__`, `__bool__` / `__int__` / `__float__` / `__index__`, `nonzero`) waits for the
launch queue to drain. `HostReadCounter` wraps those entry points on `torch.Tensor` while it is
active and counts calls, with the call site of each:
- `inside`: calls made within `scope()` (e.g. the model's forward, `wrap_forward`);
- `total`: all of them.
`scope(name)` counts into `scoped[name]` instead (several names may be open at once). A read
implemented by another (`__array__` -> `numpy`) counts once. The CPU cannot tell a device tensor
from a host one, so on the CPU this counts an upper bound of what CUDA syncs on.

STEP_READ_BUDGET is the most host reads a whole engine step may make (docs/host_path.md,
"The host-read budget").
Used by tests/engine/test_host_read_budget.py (the budgets) and benchmarks/host_reads.py (the
table).
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

# The whole step's host reads (schedule -> sample -> output): the sampled token ids, read once
# (engine/step_worker.py), since the scheduler needs them to append tokens, check stops and
# emit outputs. Everything else a step decides is known on the host already.
STEP_READ_BUDGET = 1

READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__",
         "__index__", "nonzero")


class HostReadCounter:
    """Counts calls of the host-read entry points of torch.Tensor while active; `scope`
    splits them into those inside a named region (e.g. the forward) and all of them."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()         # "entry file:line" of each read
        self.inside_sites: Counter[str] = Counter()  # the same, within scope()
        self.scoped: dict[str, Counter[str]] = {}    # scope name -> reads within it
        self._open: dict[str, int] = {}
        self._reading = False
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def wrapper(self_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._reading:          # one read implemented by another counts once
                return original(self_tensor, *args, **kwargs)
            caller = sys._getframe(1)
            site = f"{name} {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
            counter.total[name] += 1
            counter.sites[site] += 1
            for scope, depth in counter._open.items():
                if depth:
                    counter.scoped.setdefault(scope, Counter())[name] += 1
                    if scope == "inside":
                        counter.inside_sites[site] += 1
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

    @property
    def inside(self) -> Counter[str]:
        return self.scoped.setdefault("inside", Counter())

    @contextlib.contextmanager
    def scope(self, name: str = "inside") -> Iterator[None]:
        self._open[name] = self._open.get(name, 0) + 1
        try:
            yield
        finally:
            self._open[name] -= 1

    def reads(self, scope: str | None = None) -> int:
        """All reads (scope None) or those within `scope`."""
        counts = self.total if scope is None else self.scoped.get(scope, Counter())
        return sum(counts.values())

    def wrap(self, obj: object, method: str, scope: str) -> Callable[[], None]:
        """Count reads inside `obj.method` (an instance attribute) under `scope`; returns
        the undo."""
        original = getattr(obj, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.scope(scope):
                return original(*args, **kwargs)
        setattr(obj, method, counted)
        return lambda: obj.__dict__.pop(method, None)

    def wrap_forward(self, module: torch.nn.Module) -> Callable[[], None]:
        """Count reads inside `module.forward` as "inside" (an instance attribute: the class
        and the other instances are untouched); returns the undo."""
        return self.wrap(module, "forward", "inside")
