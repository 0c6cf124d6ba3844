"""Test harness for the scheduler: the real KVCacheManager over fake cache specs, a
deterministic 'model', and a step driver."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache import CacheKind, KVCacheManager, KVCacheSpec, build_kv_cache_config
from wideserve.types.sched_output import EngineCoreOutput, SchedulerOutput
from wideserve.engine.scheduler import Scheduler
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def full_specs() -> dict[str, KVCacheSpec]:
    """One FULL group: block arithmetic in the tests is plain (ceil(tokens / block))."""
    spec = KVCacheSpec(CacheKind.FULL, "kv", 8, torch.float32)
    return {"layers.0.kv": spec, "layers.1.kv": spec}


def hybrid_specs() -> dict[str, KVCacheSpec]:
    """A V4-like mix: sliding windows, a compressed FULL cache and a compressor state."""
    f32 = torch.float32
    win = KVCacheSpec(CacheKind.SLIDING_WINDOW, "window", 8, f32, window=8)
    return {"layers.0.window": win, "layers.1.window": win,
            "layers.1.compressed": KVCacheSpec(CacheKind.FULL, "compressed", 8, f32,
                                               compress_ratio=4),
            "layers.1.state": KVCacheSpec(CacheKind.SLIDING_WINDOW, "state", 16, f32,
                                          window=4)}


def make_kv_manager(num_blocks: int, block_size: int, prefix: bool = True,
                    specs: str = "full", mode: str = "keep",
                    max_model_len: int = 8192) -> KVCacheManager:
    """`num_blocks` usable blocks per bucket (block 0, the null block, comes on top)."""
    cc = CacheConfig(block_size=block_size, num_blocks_override=num_blocks + 1,
                     enable_prefix_caching=prefix, prefix_window_mode=mode)
    spec_map = full_specs() if specs == "full" else hybrid_specs()
    cfg = build_kv_cache_config(spec_map, cc)
    replay = 2 * (8 - 1) if mode == "replay" else None
    return KVCacheManager(cfg, cc, max_model_len, replay_tokens=replay)


def next_token(request: Request) -> int:
    """A deterministic 'model': the next token depends on the whole token list, never EOS."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens * 7) % (VOCAB - 1)


def make_request(rid: str, prompt_len: int, seed: int = 0, **params) -> Request:
    prompt = [(seed * 131 + i * 17) % (VOCAB - 1) for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=EOS)


def make_scheduler(num_blocks: int = 1024, block_size: int = 16, max_model_len: int = 8192,
                   prefix: bool = True, specs: str = "full", mode: str = "keep",
                   eos=None, **cfg) -> tuple[Scheduler, KVCacheManager]:
    kv = make_kv_manager(num_blocks, block_size, prefix, specs, mode, max_model_len)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len, eos_token_id_fallback=eos), kv


@dataclass
class Trace:
    steps: list[SchedulerOutput] = field(default_factory=list)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def final(self, rid: str) -> EngineCoreOutput:
        finals = [o for o in self.outputs[rid] if o.finished]
        assert len(finals) == 1, f"{rid}: {len(finals)} final outputs"
        return finals[0]


def step(sched: Scheduler, trace: Trace | None = None, sample=next_token) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.request_id: [sample(s.request)] for s in out.scheduled
               if s.request.num_computed_tokens >= s.request.num_tokens}
    outs = sched.update_from_output(out, sampled, None)
    if trace is not None:
        trace.steps.append(out)
        for o in outs:
            trace.outputs.setdefault(o.request_id, []).append(o)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, sample=next_token) -> Trace:
    trace = Trace()
    for _ in range(max_steps):
        if not sched.has_requests():
            return trace
        step(sched, trace, sample)
    raise AssertionError("scheduler did not drain")


class SchedulerFactory:
    """Builds schedulers for a test and, at teardown, ends whatever is left and checks that
    the KV pool is whole at idle (free + cached + used == pool, nothing referenced)."""

    def __init__(self) -> None:
        self.made: list[tuple[Scheduler, KVCacheManager]] = []

    def __call__(self, **kw) -> tuple[Scheduler, KVCacheManager]:
        sched, kv = make_scheduler(**kw)
        self.made.append((sched, kv))
        return sched, kv

    def check_idle(self) -> None:
        for sched, kv in self.made:
            sched.abort_requests(list(sched.requests))
            run_to_completion(sched)
            assert not sched.requests and sched.num_running == 0 and sched.num_waiting == 0
            counts = kv.check_integrity()
            # Refused while any request holds blocks or any block is in use.
            assert kv.usage == 0.0 and kv.reset_prefix_cache(), "blocks held at idle"
            assert all(c["used"] == 0 for c in counts.values()), counts


def staggered_greedy_outputs(make, **cfg) -> list[list[int]]:
    """Greedy outputs of five requests of mixed lengths, two admitted a step before the
    others, under a 128-token budget and `cfg` (`make`: a SchedulerFactory): the run the
    prefill-share and prefill-cap tests compare across settings."""
    sched, _ = make(max_num_batched_tokens=128, **cfg)
    reqs = [make_request(f"r{i}", n, seed=i, max_tokens=m)
            for i, (n, m) in enumerate([(40, 9), (3, 20), (70, 4), (12, 12), (1, 30)])]
    for r in reqs[:2]:
        sched.add_request(r)
    step(sched)
    for r in reqs[2:]:
        sched.add_request(r)
    run_to_completion(sched)
    return [r.output_token_ids for r in reqs]
