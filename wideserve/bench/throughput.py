"""Offline throughput: the engine (`LLM.generate`) and, side by side, transformers' `generate()`.

Both backends get the identical token-id prompts, greedy decoding and exactly `output_len` new
tokens per request (EOS ignored). The engine batches as it schedules; transformers runs one
request at a time by default (batch 1, no padding: the only valid way for DeepSeek-V4, whose HF
attention supports right padding only), or left-padded batches of `hf_batch_size` for models
where that is valid.

Engine-side extras, measured over the timed call only: the per-step time breakdown
(EngineStats.steps), prefix-cache queries/hits, prompt tokens actually computed, and the peak
KV blocks held by requests (sampled after every engine step).
"""
from __future__ import annotations

import contextlib
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from wideserve.bench.datasets import BenchRequest
from wideserve.config import EngineConfig
from wideserve.engine.step_timer import PHASES


@dataclass(slots=True)
class ThroughputResult:
    backend: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    step_breakdown: dict[str, Any] | None = None
    prefix_cache: dict[str, Any] | None = None
    kv_blocks: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(requests_per_s=self.requests_per_s, input_tokens_per_s=self.input_tokens_per_s,
                 output_tokens_per_s=self.output_tokens_per_s,
                 total_tokens_per_s=self.total_tokens_per_s)
        return d


# ----------------------------------------------------------------------------- wideserve
class KVProbe:
    """Wraps EngineCore.step to record the peak KV blocks held by requests after each step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.buckets = engine.kv_config.buckets
        self.peak_blocks = 0
        self.peak_bytes = 0
        self._step = engine.step

    def __enter__(self) -> "KVProbe":
        def step() -> Any:
            out = self._step()
            self.sample()
            return out
        self.engine.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.step                  # back to the class's method

    def sample(self) -> None:
        pools = self.engine.kv_manager.pools
        used = [p.num_usable - p.num_free_blocks for p in pools]
        self.peak_blocks = max(self.peak_blocks, sum(used))
        self.peak_bytes = max(self.peak_bytes,
                              sum(u * b.block_bytes for u, b in zip(used, self.buckets)))

    def summary(self) -> dict[str, Any]:
        pools = self.engine.kv_manager.pools
        return {"peak_blocks_in_use": self.peak_blocks,
                "peak_bytes_in_use": self.peak_bytes,
                "cached_blocks_after": sum(len(p.cached) for p in pools),
                "cached_bytes_after": sum(len(p.cached) * b.block_bytes
                                          for p, b in zip(pools, self.buckets)),
                "pool_blocks": [p.num_usable for p in pools],
                "block_bytes": [b.block_bytes for b in self.buckets]}


def step_breakdown(before: Any, after: Any, elapsed_s: float) -> dict[str, Any]:
    """Difference of two StepStats snapshots: seconds per phase, per step, share of wall time."""
    steps = after.steps - before.steps
    seconds = {p: after.seconds.get(p, 0.0) - before.seconds.get(p, 0.0) for p in PHASES}
    in_steps = sum(seconds.values())
    return {
        "steps": steps,
        "batched_tokens": after.tokens - before.tokens,
        "seconds": seconds,
        "ms_per_step": {p: 1e3 * s / steps if steps else 0.0 for p, s in seconds.items()},
        "share_of_wall": {p: s / elapsed_s for p, s in seconds.items()},
        # Outside engine steps: tokenisation-free front end, output processing, Python glue.
        "outside_steps_s": max(0.0, elapsed_s - in_steps),
    }


def _snapshot(engine: Any) -> tuple[Any, Any]:
    import copy
    stats = engine.get_stats()
    return copy.deepcopy(stats.steps), stats


def run_wideserve(llm: Any, requests: list[BenchRequest], ignore_eos: bool = True,
                  use_tqdm: bool = False) -> tuple[ThroughputResult, list[list[int]]]:
    """Time one `llm.generate` over the requests (the LLM is built and warmed by the caller)."""
    from wideserve.types.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=ignore_eos)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    engine = llm.engine
    kv = engine.kv_manager
    steps0, stats0 = _snapshot(engine)
    replayed0 = kv.stats.replayed
    with KVProbe(engine) as probe:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - t0
    steps1, stats1 = _snapshot(engine)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    queries = stats1.prefix_queries - stats0.prefix_queries
    hits = stats1.prefix_hits - stats0.prefix_hits
    result = ThroughputResult(
        backend="wideserve", num_requests=len(requests),
        input_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(t) for t in tokens), elapsed_s=elapsed,
        step_breakdown=step_breakdown(steps0, steps1, elapsed),
        prefix_cache={"queries": queries, "hits": hits,
                      "hit_rate": hits / queries if queries else 0.0,
                      "prompt_tokens_computed": stats1.prompt_tokens - stats0.prompt_tokens,
                      "preemptions": stats1.num_preemptions - stats0.num_preemptions,
                      "window_mode": kv.mode, "replay_tokens": kv.replay_tokens,
                      "replayed_tokens": kv.stats.replayed - replayed0},
        kv_blocks=probe.summary())
    return result, tokens


def build_llm(config: EngineConfig, warmup_token: int) -> Any:
    """The engine plus one short warmup generation (allocator and first-call costs), whose
    prompt shares no block with any benchmark prompt."""
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams

    llm = LLM.from_engine_config(config, skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": [warmup_token] * 8}],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def reset_prefix_cache(llm: Any) -> None:
    if not llm.engine.kv_manager.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache: blocks still in use")


# ---------------------------------------------------------------------------- transformers
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import logging
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM
    with _quiet():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]


def materialise_hf_random_weights(config_dir: Path, dtype: torch.dtype, seed: int,
                                  out_dir: Path | None = None) -> Path:
    """For a dummy-weight comparison both backends need the *same* weights: build the HF model
    from config.json with transformers' own random init and save it as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="wideserve-bench-"))
    torch.manual_seed(seed)
    with _quiet():
        cfg = AutoConfig.from_pretrained(str(config_dir))
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(out, safe_serialization=True)  # type: ignore[call-arg,arg-type]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = Path(config_dir) / name
        if src.is_file() and not (out / name).exists():
            (out / name).write_bytes(src.read_bytes())
    return out


@torch.inference_mode()
def run_hf(model: Any, requests: list[BenchRequest], batch_size: int = 1,
           pad_token_id: int = 0) -> tuple[ThroughputResult, list[list[int]]]:
    """transformers `generate()`: greedy, exactly output_len new tokens (EOS disabled).

    batch_size 1: one request at a time, no padding. batch_size > 1: left-padded batches of
    requests with equal output_len (the caller checks the model allows padding)."""
    device = next(model.parameters()).device
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with _quiet():
        for i in range(0, len(requests), batch_size):
            chunk = requests[i:i + batch_size]
            n_out = chunk[0].output_len
            if any(r.output_len != n_out for r in chunk):
                raise ValueError("hf batches need equal output lengths (use range_ratio 0)")
            width = max(r.prompt_len for r in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for k, r in enumerate(chunk):
                ids[k, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[k, width - r.prompt_len:] = 1
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_token_id)
            tokens.extend(out[:, width:].tolist())
    elapsed = time.perf_counter() - t0
    mode = "batch 1, no padding" if batch_size == 1 else f"left-padded batches of {batch_size}"
    return ThroughputResult(
        backend="transformers", num_requests=len(requests),
        input_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(t) for t in tokens), elapsed_s=elapsed,
        notes=[f"transformers generate(): greedy, {mode}, eos disabled, "
               f"min_new_tokens = max_new_tokens = output_len, KV cache on (DynamicCache)"]), tokens


def hf_padding_allowed(config_json: dict) -> bool:
    """DeepSeek-V4's HF attention is valid with right padding only (model-arch.md §9.2), and
    generate() pads left: batch 1 is the only faithful way to run it."""
    return config_json.get("model_type") != "deepseek_v4"


def hf_warmup(model: Any, token: int) -> None:
    run_hf(model, [BenchRequest([token] * 8, 2)])


def median_result(results: list[ThroughputResult]) -> ThroughputResult:
    """The repeat with the median elapsed time (robust to a noisy neighbour on a shared box)."""
    ordered = sorted(results, key=lambda r: r.elapsed_s)
    return ordered[(len(ordered) - 1) // 2]
