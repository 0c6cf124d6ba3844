"""Whether an engine holds its routed experts in the lossless 12-bit form
(KernelConfig.lossless_experts; kernels/lossless.py, docs/cpu_kernels.md "Lossless 12-bit
expert weights").

"on" codes them wherever the coded op runs (AMX-BF16, bf16 experts on the fused path, widths
multiples of 32; layers/experts.py falls back with one warning elsewhere), "off" never. "auto"
(the default) codes them where that is measured to pay on the machine in use. A batched decode
step reads every expert's weights once, and the coding saves a quarter of those bytes: it pays
only where the steps wait on memory for them. So "auto" leaves the bf16 packs alone where they
fit in the CPU's last-level cache (every model the tests start: nothing to time, nothing
changes), and elsewhere, where the engine warms up, times decode-shaped steps (DECODE_ROWS
one-token requests, so every expert gets a few rows) alternately on the bf16 and the coded
packs; the coded packs stay when the best coded step is at least GAIN faster, and the other
form is freed. Both forms are held while they are timed: "auto" does not time where the
memory available cannot hold the coded copy beside the bf16 one.

The outputs of the two forms are the same for every expert the bf16 path runs on brgemm; the
few-row experts the bf16 path gives the AVX512 micro-kernel run on AMX tiles in the coded
form, whose sums round alike but not always to the same bf16 (like any kernel choice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from wideserve.kv_cache.host_memory import available_bytes
from wideserve.layers.experts import RoutedExperts
from wideserve.utils.cpu_cache import last_level_cache_bytes

DECODE_ROWS = 64        # one-token requests of a timed step: a batched decode's MoE shape
REPEATS = 3             # timed steps per form, alternating; the least of each kept
GAIN = 0.95             # the coded packs must cut that step by 5% or more
CODED_SHARE = 0.75      # the coded bytes per bf16 byte (kernels/lossless.py)
UNKNOWN_LLC = 32 << 20  # the cache assumed where sysfs reports none (a server CPU's order)


@dataclass(frozen=True, slots=True)
class Decision:
    on: bool
    note: str           # why, for the log line


def coded_layers(model: torch.nn.Module, dtype: torch.dtype) -> list[RoutedExperts]:
    """The model's routed-expert layers whose fused path could run on coded packs."""
    return [m for m in model.modules()
            if isinstance(m, RoutedExperts) and m.coded_usable(dtype)]


def last_level_cache() -> int:
    """Bytes of the CPU's last-level cache; UNKNOWN_LLC where Linux reports none."""
    return last_level_cache_bytes() or UNKNOWN_LLC


def decide(mode: str, layers: list[RoutedExperts], measurable: bool,
           timings: Callable[[], tuple[float, float]], llc: int | None = None,
           free: int | None = None) -> Decision:
    """The decision from the mode and what was found; `timings` returns (best bf16 step, best
    coded step) seconds and is called only when "auto" needs it; `llc` / `free`: the
    last-level cache and the memory available (None: read from the OS)."""
    if mode == "off":
        return Decision(False, "off (--lossless-experts off)")
    if not layers:
        return Decision(False, f"{mode}: no routed experts the coded op runs here (it needs "
                               f"AMX-BF16, bf16 weights on the fused path, widths multiple "
                               f"of 32)")
    if mode == "on":
        return Decision(True, "on (--lossless-experts on)")
    packs = sum(m.pack_bytes() for m in layers)
    llc = last_level_cache() if llc is None else llc
    if packs <= llc:
        return Decision(False, f"auto: off, the experts' {packs / 2**20:.0f} MiB fit in the "
                               f"{llc / 2**20:.0f} MiB last-level cache")
    if not measurable:
        return Decision(False, "auto: off (not timed here: no warm-up step, or parallel ranks)")
    free = available_bytes() if free is None else free
    if free is not None and free < 1.25 * CODED_SHARE * packs:
        return Decision(False, f"auto: off (not timed: {free / 2**30:.1f} GiB available, "
                               f"the coded copy needs {CODED_SHARE * packs / 2**30:.1f})")
    plain, coded = timings()
    on = coded <= GAIN * plain
    return Decision(on, f"auto: {'on' if on else 'off'}, a {DECODE_ROWS}-request decode-shaped "
                        f"step {plain * 1e3:.1f} ms on bf16, {coded * 1e3:.1f} ms coded")


def measure(layers: list[RoutedExperts], timed_step: Callable[[], float]
            ) -> tuple[float, float]:
    """(best seconds on the bf16 packs, best on the coded packs) of `timed_step`, alternating;
    leaves both forms built (apply() frees one)."""
    best = {False: math.inf, True: math.inf}
    for _ in range(REPEATS):
        for on in (False, True):
            for m in layers:
                m.lossless = on
            best[on] = min(best[on], timed_step())
    return best[False], best[True]


def apply(layers: list[RoutedExperts], on: bool) -> None:
    """Every layer on the decided form, the other form's packs freed."""
    for m in layers:
        m.lossless = on
        m.drop_unused_packs()


def decode_shaped(sched: Any) -> list[int]:
    """The timed step's prompt lengths: DECODE_ROWS one-token requests (fewer where
    max_num_seqs is smaller)."""
    return [1] * max(1, min(DECODE_ROWS, sched.max_num_seqs))


def resolve(mode: str, model: torch.nn.Module, dtype: torch.dtype, measurable: bool,
            timed: Callable[[list[int]], float], sched: Any) -> Decision:
    """decide() and apply() for an engine: `timed(lengths)` times one fresh prefill step of
    those prompt lengths (worker/memory_profile.py timed_prefill)."""
    layers = coded_layers(model, dtype)
    lengths = decode_shaped(sched)
    decision = decide(mode, layers, measurable,
                      lambda: measure(layers, lambda: timed(lengths)))
    apply(layers, decision.on)
    return decision
