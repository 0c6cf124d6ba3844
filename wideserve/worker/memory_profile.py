"""Size the KV cache after measuring a maximal step's activations (docs/memory.md).

On an accelerator the KV cache takes what is left of `gpu_memory_utilization` x total memory
once the weights are loaded AND the largest step the scheduler can build has run: a maximal
dummy batch (max_num_batched_tokens tokens over as many requests as max_num_seqs allows, every
request sampled) goes through a throwaway runner on a KV cache just big enough for it, and
the peak memory above the baseline is the activation reserve. This is vLLM's profile run.
Without it the KV cache took 0.9 x free memory and the first large prefill could run out.

Device-agnostic: the memory statistics come from `torch.<device type>` (cuda, xpu, ...) when
the backend has them; on CPU there are none and sizing keeps its CPU default, but the dummy
step itself runs anywhere (the tests run it on CPU with a stand-in probe).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import allocate_kv_tensors, build_kv_cache_config
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.worker.model_runner import GroupLayout, ModelRunner, StepRequest
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams

_STATS = ("mem_get_info", "memory_allocated", "max_memory_allocated",
          "reset_peak_memory_stats", "synchronize", "empty_cache")


class DeviceMemory:
    """Memory statistics of one accelerator, through torch's per-backend module."""

    def __init__(self, device: torch.device, backend: Any) -> None:
        self.device, self.backend = device, backend

    @staticmethod
    def for_device(device: torch.device) -> "DeviceMemory | None":
        backend = getattr(torch, device.type, None) if device.type != "cpu" else None
        if backend is None or not all(hasattr(backend, n) for n in _STATS):
            return None
        return DeviceMemory(device, backend)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.backend.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        return int(self.backend.memory_allocated(self.device))

    def peak(self) -> int:
        return int(self.backend.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        self.backend.reset_peak_memory_stats(self.device)

    def settle(self) -> None:
        self.backend.synchronize(self.device)
        self.backend.empty_cache()


@dataclass(slots=True)
class MemoryProfile:
    total: int               # device memory
    used_before: int         # in use after loading (weights, context, other processes)
    activation_peak: int     # a maximal step's peak above its baseline
    budget: int              # what the KV cache gets


def dummy_lengths(sched: SchedulerConfig, max_model_len: int) -> list[int]:
    """Tokens per request of the largest step: the whole token budget over as many requests
    as max_num_seqs allows (more sampled rows = more logits), none longer than a request may
    be."""
    per = max(1, max_model_len - 1)
    total = min(sched.max_num_batched_tokens, sched.max_num_seqs * per)
    n = min(sched.max_num_seqs, total)
    n = max(n, math.ceil(total / per))
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def run_dummy_step(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
                   max_model_len: int, device: torch.device) -> int:
    """One maximal step on a throwaway KV cache sized for exactly it; returns the tokens."""
    lengths = dummy_lengths(sched, max_model_len)
    runner, reqs = throwaway_step(model, specs, cache, sched, max_model_len, device, lengths)
    runner.forward(reqs)
    return sum(lengths)


# The start-up warm-up's prompt: a few tokens (a prefill of several rows, then one decode row).
WARM_UP_TOKENS = 8


def run_warm_up(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
                max_model_len: int, device: torch.device) -> None:
    """A short prefill and one decode step on a throwaway KV cache, so that what a model
    makes at its first forward (the kernels' packed weight copies, kernel timings of shapes
    no layer declared) is made at start-up, inside the engine's ready deadline, and not in
    the first request's step, where it once outlasted the front end's stall timeout (a 653M
    model's packing took 10-12 s at load 14 on 2 vCPUs)."""
    n = min(WARM_UP_TOKENS, max(1, max_model_len - 1))
    runner, reqs = throwaway_step(model, specs, cache, sched, max_model_len, device, [n + 1])
    prompt = reqs[0]
    runner.forward([dataclasses.replace(prompt, token_ids=prompt.token_ids[:n])])
    runner.forward([dataclasses.replace(prompt, token_ids=prompt.token_ids[n:], start=n,
                                        is_new=False)])


def throwaway_step(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
                   max_model_len: int, device: torch.device, lengths: list[int],
                   vocab: int = 0, prompt_logits: bool = True,
                   ) -> tuple[ModelRunner, list[StepRequest]]:
    """A runner on a KV cache with pages for exactly `lengths`' requests, and those
    requests as one fresh prefill step: token 0 repeated, or (`vocab` > 0) seeded random
    tokens below `vocab`, so that a MoE routes them as it would a real prompt's."""
    tmp = dataclasses.replace(cache, enable_prefix_caching=False, num_blocks_override=2,
                              kv_cache_memory=None)
    kv_config = build_kv_cache_config(specs, tmp, sched, device=device)
    for bucket in kv_config.buckets:             # pages for every request's whole chunk
        bucket.num_blocks = 1 + sum(math.ceil(n / kv_config.groups[g].block_size) + 1
                                    for g in bucket.group_ids for n in lengths)
    caches = allocate_kv_tensors(kv_config, device)
    manager = KVCacheManager(kv_config, tmp, max_model_len)
    reqs = []
    rng = random.Random(0)
    for i, n in enumerate(lengths):
        ids = [rng.randrange(vocab) for _ in range(n)] if vocab > 0 else [0] * n
        r = Request(f"profile-{i}", ids, SamplingParams(max_tokens=1))
        if manager.allocate_slots(r, n) is None:
            raise RuntimeError("memory profiling: the dummy KV cache is too small")
        # prompt_logits: every row through every layer (a prompt-logprobs step's peak; the
        # V4.1 decoder bounded replay would run its last layers on fewer rows otherwise).
        reqs.append(StepRequest(r.request_id, r.prompt_token_ids, 0,
                                manager.block_ids(r.request_id), prompt_logits=prompt_logits,
                                is_new=True))
    layouts = [GroupLayout(g.block_size, g.compress_ratio) for g in kv_config.groups]
    return ModelRunner(model, layouts, kv_config.cache_group, caches, device), reqs


def timed_prefill(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
                  max_model_len: int, device: torch.device, lengths: list[int],
                  vocab: int) -> float:
    """Seconds of one fresh prefill step of `lengths`' requests of seeded random tokens below
    `vocab` on a throwaway cache (throwaway_step), the last row of each prompt sampled; the
    device synchronised around it (the start-up timings: worker/prefill_cap.py,
    worker/weight_streaming.py)."""
    sync = (lambda: None) if device.type == "cpu" else getattr(torch, device.type).synchronize
    runner, reqs = throwaway_step(model, specs, cache, sched, max_model_len, device, lengths,
                                  vocab=vocab, prompt_logits=False)
    sync()
    t0 = time.perf_counter()
    runner.forward(reqs)
    sync()
    return time.perf_counter() - t0


def profile_kv_budget(probe: DeviceMemory, utilization: float, run_step: Any) -> MemoryProfile:
    """KV budget = utilization x total - memory in use now - a maximal step's activations."""
    probe.settle()
    free, total = probe.mem_get_info()
    used = total - free
    probe.reset_peak()
    base = probe.allocated()
    run_step()
    probe.settle()
    activation = max(0, probe.peak() - base)
    budget = int(total * utilization) - used - activation
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: of "
            f"{total / gib:.2f} GiB, {used / gib:.2f} GiB are in use (weights, other "
            f"processes) and a maximal step needs {activation / gib:.2f} GiB of activations; "
            f"raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
    return MemoryProfile(total, used, activation, budget)
