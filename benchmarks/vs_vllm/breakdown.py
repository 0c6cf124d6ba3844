"""Per-step time split of a wideserve engine (offline_worker.py --profile-breakdown).

Phases come from the engine's own StepTimer (engine/step_timer.py): schedule, prepare, forward,
sample, output. The forward is split further by forward hooks on the model's modules:
- "attention": every `*.self_attn` module (projections, q/k norms, RoPE and the attention op),
  of which "attention_op" is the paged attention backend call itself (KV write, gather, SDPA);
- "moe": every `*.mlp` module that holds routed experts (router, experts, shared expert);
- "other": the rest of the forward (embedding, norms, residuals, dense MLPs, LM head, the
  batch build and metadata uploads).
Hooks sync the device before reading the clock (CUDA), like the StepTimer. They see only an
eager forward: with a compiled decode step the split covers the eager (prefill) steps only,
so run a breakdown with --enforce-eager 1 when the split is what you want.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from wideserve.engine.step_timer import PHASES
from wideserve.models.llama import model as llama


class _Clock:
    """Accumulates wall time between enter and exit calls, nesting-safe per key."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.total: dict[str, float] = {"attention": 0.0, "attention_op": 0.0, "moe": 0.0}
        self._t0: dict[str, float] = {}

    def enter(self, key: str) -> None:
        self.sync()
        self._t0[key] = time.perf_counter()

    def exit(self, key: str) -> None:
        self.sync()
        self.total[key] += time.perf_counter() - self._t0.pop(key)


class ForwardBreakdown:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.clock = _Clock(engine.device)
        stats = engine.timer.stats
        self._steps0, self._secs0 = stats.steps, dict(stats.seconds)
        self._handles = []
        for name, module in engine.model.named_modules():
            if name.endswith(".self_attn"):
                self._hook(module, "attention")
            elif name.endswith(".mlp") and hasattr(module, "experts"):
                self._hook(module, "moe")
        self._lookup = llama.get_paged_attention_backend
        llama.get_paged_attention_backend = self._timed_lookup

    def _hook(self, module: torch.nn.Module, key: str) -> None:
        clock = self.clock
        self._handles.append(module.register_forward_pre_hook(lambda *_: clock.enter(key)))
        self._handles.append(module.register_forward_hook(lambda *_: clock.exit(key)))

    def _timed_lookup(self, name: str):
        fn, clock = self._lookup(name), self.clock

        def timed(*args, **kwargs):
            clock.enter("attention_op")
            try:
                return fn(*args, **kwargs)
            finally:
                clock.exit("attention_op")
        return timed

    def report(self) -> dict[str, float]:
        """Milliseconds per step since construction; removes the hooks."""
        for h in self._handles:
            h.remove()
        llama.get_paged_attention_backend = self._lookup
        stats = self.engine.timer.stats
        steps = max(stats.steps - self._steps0, 1)
        ms = {p: 1e3 * (stats.seconds[p] - self._secs0[p]) / steps for p in PHASES}
        split = {k: 1e3 * v / steps for k, v in self.clock.total.items()}
        ms.update({f"forward.{k}": v for k, v in split.items()})
        ms["forward.other"] = ms["forward"] - split["attention"] - split["moe"]
        ms["steps"] = steps
        return {k: round(v, 3) for k, v in ms.items()}
