"""A check, on any device, that a forward is what a CUDA graph can record (docs/cuda_graphs.md).

A CUDA graph records the kernels one run launches and replays them with the same shapes,
reading the same addresses. A forward breaks that where it
- synchronises with the host: reads a device value back (`.item()`, `int(t)`, `bool(t)`,
  `.tolist()`, `.numpy()`, `.cpu()`) or calls an op whose output shape is the data's
  (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `bincount`,
  `repeat_interleave` without `output_size`): on CUDA each of these waits for the device, and
  during capture it fails;
- feeds the device a tensor built on the host during the forward (from numpy, from a list):
  a graph bakes in the first step's copy and replays it for ever;
- calls a CPU-only op (the C++ extension's `wideserve::` ops, oneDNN's `mkldnn::`), which
  means a CPU path ran where the CUDA path was meant to;
- with `host_tables=False`, reads a table kept in host memory (a `HostResident` module's,
  layers/engram.py): on CUDA its rows are gathered by ids the host must read, so a
  captured step stages those rows before the replay (decode_capture.py, DecodeStaging).

`CaptureGuard` raises `CaptureViolation` on the first of these while it is active: a
TorchFunctionMode sees the read-backs (Tensor methods), a TorchDispatchMode sees every op.
For the host-built tensors it tracks where each op's tensor inputs come from: tensors alive
when the guard was made (parameters, buffers, caches, static input buffers) or outputs of
ops run under the guard; anything else was made during the forward without an op. It also
records a trace of every op with its tensor shapes and scalar arguments: two steps of the
same padded size must record the same trace (what a graph replays), whatever the contexts.

`FullgraphCapturer` holds a forward to the same discipline through torch.compile(fullgraph=True)
(tests/models/test_decode_fullgraph.py). It runs on CPU tensors, so the CPU tests hold the
CUDA decode path to all of this
(tests/models/test_cuda_decode_path.py); `GuardedCapturer` applies it to the captured decode
step of a whole engine (tests/engine/test_decode_capture.py) and, on a GPU, before the real
capture (benchmarks/cuda_graph_check.py).
"""
from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from wideserve.layers.engram import HostResident

aten = torch.ops.aten

# Ops that read a device value on the host or size their output from the data.
_SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
             aten.allclose.default}
_DATA_SHAPED_OPS = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
                    aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                    aten.unique_consecutive.default, aten.argwhere.default,
                    aten.nonzero_numpy.default, aten.masked_scatter.default}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default}
_CPU_ONLY_NAMESPACES = ("wideserve", "mkldnn")
# Tensor methods that copy a value to the host (on CUDA: a sync).
_READBACKS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.cpu,
              torch.Tensor.__array__, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__}


class CaptureViolation(RuntimeError):
    """The guarded forward did something a CUDA graph cannot record."""


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, torch.ScriptObject):
        # A collective's process group: a new wrapper object per call, so its type, not its
        # address (repr), is what two steps must agree on.
        return ("ScriptObject", x._type().qualified_name())
    return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)


class _Storages:
    """Storage pointers of live tensors, each checked against a weak reference (a freed
    tensor's address may be reused by a host-built one)."""

    def __init__(self) -> None:
        self._refs: dict[int, list[weakref.ref]] = {}

    def add(self, t: torch.Tensor) -> None:
        ptr = _ptr(t)
        if ptr:
            self._refs.setdefault(ptr, []).append(weakref.ref(t))

    def __contains__(self, t: torch.Tensor) -> bool:
        ptr = _ptr(t)
        refs = self._refs.get(ptr, ())
        return any((r := ref()) is not None and _ptr(r) == ptr for ref in refs)


class _ReadbackMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READBACKS:
            raise CaptureViolation(f"Tensor.{func.__name__} reads a device value on the host "
                                   f"(a sync)")
        return func(*args, **(kwargs or {}))


class _OpMode(TorchDispatchMode):
    def __init__(self, guard: CaptureGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.guard._check(func, args, kwargs)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.guard._made.add(t)
        return out


class CaptureGuard:
    """Context manager: the forward run inside it must be capturable, else CaptureViolation.

    Tensors alive when the guard is made count as the forward's inputs (make it after the
    warm-up, as capture does); `allow` adds tensors made later (an eager step's batch)."""

    def __init__(self, host_tables: bool = True) -> None:
        """host_tables False: reading a HostResident module's tensors is a violation."""
        self._known = _Storages()
        self._host_only = _Storages()
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):     # (isinstance trips lazy proxies)
                self._known.add(obj)
            elif not host_tables and issubclass(type(obj), HostResident):
                for t in (*obj.parameters(), *obj.buffers()):
                    self._host_only.add(t)
        self._made = _Storages()
        self.trace: list[tuple] = []
        self._modes: list[Any] = []

    def allow(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._known.add(t)

    def __enter__(self) -> CaptureGuard:
        self.trace, self._made = [], _Storages()
        self._modes = [_ReadbackMode(), _OpMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def _check(self, func, args: tuple, kwargs: dict) -> None:
        name = str(func)
        leaves = tree_flatten((args, kwargs))[0]
        self.trace.append((name, tuple(_signature(x) for x in leaves)))
        if func.namespace in _CPU_ONLY_NAMESPACES:
            raise CaptureViolation(f"{name} is a CPU-only op: the CPU path ran")
        if func in _SYNC_OPS:
            raise CaptureViolation(f"{name} reads a device value on the host (a sync)")
        if func in _DATA_SHAPED_OPS:
            raise CaptureViolation(f"{name}: its output shape depends on the data (a sync)")
        if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            raise CaptureViolation(f"{name} without output_size sizes its output from the data")
        if func in _INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in tree_flatten(args[1])[0]):
            raise CaptureViolation(f"{name} with a boolean mask: a data-dependent shape")
        for x in leaves:
            if isinstance(x, torch.Tensor) and x in self._host_only:
                raise CaptureViolation(f"{name} reads a host-resident table {tuple(x.shape)}: "
                                       f"on CUDA by row ids read back from the device")
            if isinstance(x, torch.Tensor) and x not in self._made and x not in self._known:
                raise CaptureViolation(
                    f"{name} reads a tensor {tuple(x.shape)} {x.dtype} built during the forward "
                    f"without an op (from the host: numpy, a list): a graph would replay the "
                    f"first step's copy")


class GuardedCapturer:
    """A capturer (worker/decode_capture.py) that checks instead of recording: per size, a
    warm-up run, then the run under one CaptureGuard (made after the first warm-up, as a
    graph's inputs exist by then) whose trace is kept; every replay runs the forward again
    under the guard and must record the same trace: the kernels a graph would replay.
    `replays` counts them. A captured step stages what it reads of host-resident tables
    before the replay, so the guard here refuses any read of one (`host_tables=False`)."""

    def __init__(self) -> None:
        self.guard: CaptureGuard | None = None
        self.traces: list[list[tuple]] = []
        self.replays = 0

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        run()                                   # warm-up: lazy state (packed weights...) is made
        if self.guard is None:
            self.guard = CaptureGuard(host_tables=False)
        guard = self.guard
        with guard:
            out = run()
        trace = guard.trace
        self.traces.append(trace)

        def replay() -> torch.Tensor:
            with guard:
                result = run()
            if guard.trace != trace:
                raise CaptureViolation(f"a replay recorded another trace than its capture: "
                                       f"{_first_difference(trace, guard.trace)}")
            self.replays += 1
            out.copy_(result)                   # a graph's replay writes its static output
            return out
        return replay


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x} != {y}"
    return f"{len(a)} ops != {len(b)} ops"


class FullgraphCapturer:
    """A capturer (worker/decode_capture.py) that compiles instead of recording: per size, a
    warm-up run, then the model's forward compiled with torch.compile(fullgraph=True) for
    that size's static batch, which fails on any graph break (a host read, a data-dependent
    branch or shape, an op dynamo cannot trace): the discipline a CUDA graph needs, checked
    on any device. Replays run the compiled forward. `backend` "eager" or "aot_eager" keeps
    the check fast (dynamo finds graph breaks whatever the backend)."""

    def __init__(self, model: torch.nn.Module, backend: str = "eager") -> None:
        self.model, self.backend = model, backend
        self.compiled = 0
        self.replays = 0

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1" or torch._dynamo.config.disable:
            # torch.compile then runs the function eagerly: the check would pass vacuously
            raise RuntimeError("FullgraphCapturer: torch.compile is disabled in this process "
                               "(TORCHDYNAMO_DISABLE=1 or torch._dynamo.config.disable)")
        run()                                   # warm-up: lazy state is made eagerly
        forward = torch.compile(type(self.model).forward.__get__(self.model), fullgraph=True,
                                backend=self.backend, dynamic=False)

        def replay() -> torch.Tensor:
            self.model.forward = forward        # an instance attribute, for this run only
            try:
                return run()
            finally:
                del self.model.forward
        replay()
        self.compiled += 1

        def counted() -> torch.Tensor:
            self.replays += 1
            return replay()
        return counted
