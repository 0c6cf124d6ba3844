"""Whether an engine streams its MoE weights (ParallelConfig.weight_streaming; the helper is
kernels/weight_stream.py, docs/cpu_kernels.md "Weight streaming").

The helper needs a core the engine's threads leave idle: the front end's core of a served
engine (bound plans, utils/threads.py), or the cores an in-process engine does not use. In
"auto" it runs only where it is measured to pay on the machine in use: where the engine
warms up (one CPU engine, bf16 weights), fresh prefill steps of PROMPT_TOKENS random tokens
are timed alternately without and with it, and it stays on when the best step with it is
at least GAIN faster and the model's MoE calls posted plans at all (a model whose calls are
all under kernels/weight_stream.MIN_PLAN_BYTES has nothing to stream). It never changes a
result (it only reads weights), so "on" forces it (A/B runs) and "off" never starts it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kernels import weight_stream
from wideserve.utils.threads import ThreadPlan
from wideserve.worker.memory_profile import timed_prefill

PROMPT_TOKENS = 128     # a lone prompt's step: where one thread waits on weights the most
REPEATS = 3             # timed steps per setting, alternating; the least of each kept
GAIN = 0.95             # the helper must cut that step by 5% or more


@dataclass(frozen=True, slots=True)
class Decision:
    on: bool
    cpus: tuple[int, ...]     # the helper's CPUs (() = not bound)
    note: str                 # why, for the log line


def idle_cores(plan: ThreadPlan | None, threads: int,
               usable: int | None = None) -> tuple[bool, tuple[int, ...]]:
    """(whether a core is left idle for the helper, the CPUs to bind it to): a bound plan's
    spare cores; an unbound engine (LLM(), a set count) has one when its threads are fewer
    than the cores this process may use, and the helper is left unbound (the OS places it)."""
    if plan is not None and plan.cpus:
        return bool(plan.spare), plan.spare
    usable = usable if usable is not None else len(os.sched_getaffinity(0))
    return threads < usable, ()


def measure(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
            max_model_len: int, device: torch.device, vocab: int,
            cpus: tuple[int, ...]) -> tuple[float, float, int] | None:
    """(best step seconds without, with the helper, the plans its calls posted) of a fresh
    prefill of PROMPT_TOKENS random tokens (None where the limits cannot hold one); leaves
    the helper stopped."""
    tokens = min(PROMPT_TOKENS, sched.max_num_batched_tokens, max(1, max_model_len - 1))
    if sched.max_num_seqs < 1 or tokens < 1:
        return None
    best = {False: math.inf, True: math.inf}
    plans = 0
    for _ in range(REPEATS):
        for on in (False, True):
            if on:
                weight_stream.start(cpus)
            best[on] = min(best[on], timed_prefill(model, specs, cache, sched, max_model_len,
                                                   device, [tokens], vocab))
            if on:
                plans += weight_stream.stats().plans
            weight_stream.stop()
    return best[False], best[True], plans


def decide(mode: str, ops: bool, demotes: bool, idle: bool, cpus: tuple[int, ...],
           measurable: bool, timings: Any) -> Decision:
    """The decision from the mode and what was found (ops: the C++ ops load; demotes: the CPU
    has CLDEMOTE); `timings` is a zero-argument callable returning measure()'s answer,
    called only when "auto" needs it."""
    if mode == "off":
        return Decision(False, cpus, "off (--weight-streaming off)")
    if not ops:
        return Decision(False, cpus, "off: the C++ CPU ops do not load here")
    if mode == "on":
        return Decision(True, cpus, "on (--weight-streaming on)")
    if not demotes:
        return Decision(False, cpus, "off: the CPU has no CLDEMOTE (the helper's reads would "
                                     "stay in its own core's cache)")
    if not idle:
        return Decision(False, cpus, "off: no core is left idle for the helper")
    if not measurable:
        return Decision(False, cpus, "off: not measured here (only one CPU engine with bf16 "
                                     "weights measures it)")
    found = timings()
    if found is None:
        return Decision(False, cpus, "off: no prefill step fits the limits to time it")
    without, with_, plans = found
    if plans == 0:
        return Decision(False, cpus, "off: no MoE call of this model reads enough weights to "
                                     f"stream (calls under {weight_stream.MIN_PLAN_BYTES >> 20} "
                                     "MB are not posted)")
    verdict = with_ <= GAIN * without
    return Decision(verdict, cpus, f"{'on' if verdict else 'off'}: a {PROMPT_TOKENS}-token "
                                   f"prefill step {without * 1e3:.1f} ms without, "
                                   f"{with_ * 1e3:.1f} ms with")


def where(cpus: tuple[int, ...]) -> str:
    return f"on CPU {','.join(map(str, cpus))}" if cpus else "unbound"
