"""Engine configuration: what to load, how to cache, how to schedule."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from wideserve.disagg.config import KVTransferConfig
from wideserve.spec_decode.config import SpeculativeConfig


@dataclass(slots=True)
class LoadConfig:
    model: str | None = None                 # directory, .gguf file, or None = bundled model
    dtype: str = "auto"                      # auto | float32 | bfloat16 | float16
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    seed: int = 0
    device: str = "cpu"
    tokenizer: str | None = None             # defaults to the model directory


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 256                    # positions per logical (hash) block
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    kv_cache_memory: int | None = None       # bytes for KV on CPU; None = a default budget
    gpu_memory_utilization: float = 0.9      # fraction of free device memory on GPU
    num_blocks_override: int | None = None   # testing: exact pool size in blocks per bucket
    # How the sliding-window and compressor state is restored on a prefix hit:
    # "keep" caches the window/state blocks with the prefix; "replay" recomputes them.
    prefix_window_mode: Literal["keep", "replay"] = "keep"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None         # None = the model's limit
    long_prefill_token_threshold: int = 0    # 0 = no per-request cap below the budget
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_new_requests_per_step: int = 0       # 0 = no cap
    num_lookahead_tokens: int = 0            # speculative draft slots reserved per request


@dataclass(slots=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None     # None = no speculative decoding
    kv_transfer: KVTransferConfig | None = None      # None = no P/D disaggregation


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Flat keyword arguments (as `LLM(...)` takes them) -> EngineConfig; an unknown name is a
    TypeError naming it. `speculative_config` takes a dict, a JSON string or a
    SpeculativeConfig (as vLLM's LLM does)."""
    parts = {"load": LoadConfig(), "cache": CacheConfig(), "scheduler": SchedulerConfig()}
    speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
    kv_transfer = KVTransferConfig.parse(kwargs.pop("kv_transfer_config", None))
    for key, value in kwargs.items():
        owner = next((p for p in parts.values() if key in p.__dataclass_fields__), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        setattr(owner, key, value)
    return EngineConfig(**parts, speculative=speculative,  # type: ignore[arg-type]
                        kv_transfer=kv_transfer)
