"""Counting host reads of the device (docs/testing.md, "Counting host reads").

On a GPU every read of a device tensor by the host (`Tensor.item`, `tolist`, `cpu`, `numpy`,
`__array__`, `__bool__` / `__int__` / `__float__` / `__index__`, `nonzero`) waits for the
launch queue to drain. `HostReadCounter` wraps those entry points on `torch.Tensor` while it is
active and counts calls, with the call site of each:
- `inside`: calls made within `scope()` (e.g. the model's forward, `wrap_forward`);
- `total`: all of them.
A read implemented by another (`__array__` -> `numpy`) counts once. The CPU cannot tell a
device tensor from a host one, so on the CPU this counts an upper bound of what CUDA syncs on.
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

READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__",
         "__index__", "nonzero")


class HostReadCounter:
    """Counts calls of the host-read entry points of torch.Tensor while active; `scope`
    splits them into those inside a named region (e.g. the forward) and all of them."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()         # "entry file:line" of each read
        self.inside_sites: Counter[str] = Counter()  # the same, within scope()
        self._depth = 0
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
            if counter._depth:
                counter.inside[name] += 1
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

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def wrap_forward(self, module: torch.nn.Module) -> Callable[[], None]:
        """Count reads inside `module.forward` (an instance attribute: the class and the
        other instances are untouched); returns the undo."""
        forward = module.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.scope():
                return forward(*args, **kwargs)
        module.forward = counted
        return lambda: module.__dict__.pop("forward", None)

    def forward_reads(self) -> int:
        return sum(self.inside.values())

    def step_reads(self) -> int:
        return sum(self.total.values())
