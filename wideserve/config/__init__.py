"""Engine configuration: what to load, how to cache, how to schedule."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.config.eplb import EplbConfig
from wideserve.config.multimodal import MultiModalLimits
from wideserve.config.speculative import SpeculativeConfig


@dataclass(slots=True)
class LoadConfig:
    model: str | None = None                 # directory, .gguf file, or None = bundled model
    dtype: str = "auto"                      # auto | float32 | bfloat16 | float16
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    seed: int = 0
    device: str = "cpu"
    tokenizer: str | None = None             # defaults to the model directory
    # DeepSeek-V4.1's decoder bounded replay (exact; docs/deepseek_v41.md): the last KV
    # source and the layers after it run only on the rows whose results are read. None: on
    # where the model supports it; True: required (an error on other models); False: off.
    decoder_bounded_replay: bool | None = None
    # Run the forward eagerly (True) or compiled (False: torch.compile of the decoder layers,
    # the attention op left eager; docs/cpu_kernels.md). None = the device's default: eager on
    # the CPU, where compiling costs tens of seconds against a 2-5 s start; compiled elsewhere.
    enforce_eager: bool | None = None
    # The captured decode step (worker/decode_capture.py): decode batches padded to capture
    # sizes over static buffers, CUDA graphs where the model is capturable. None = on CUDA for
    # a capturable model, off on the CPU (measured, docs/host_path.md); --enforce-eager turns
    # it off, as in vLLM; True/False force it.
    decode_capture: bool | None = None
    # The small-batch decode path (worker/small_batch.py, docs/host_path.md): decode steps of
    # up to this many requests over preallocated inputs with the model's plan kept across
    # steps. 0 turns it off (A/B runs).
    small_batch_decode: int = 4
    # Small-M GEMMs on that path (layers/small_m.py): plain nn.Linear models (DeepSeek-V4 /
    # V4.1) run the kernel table's small-row GEMM in small steps instead of oneDNN's F.linear.
    # In bf16 they round a value one ulp apart from F.linear on rare values, another
    # batch-dependent choice of the default mode (fp32 greedy outputs are equal; docs/
    # cpu_kernels.md, "Batch invariance"); --batch-invariant never uses them.
    # --no-small-batch-gemms (False) keeps F.linear on the path.
    small_batch_gemms: bool = True
    # The persistent decode batch (worker/decode_batch.py, docs/host_path.md): every other
    # decode step over inputs kept across steps, the model's plan kept per batch size. False
    # plans every step (A/B runs).
    persistent_decode_batch: bool = True
    # Time each step's phases (engine/step_timer.py: the host clock on the CPU, device events
    # on CUDA, never a synchronisation). False keeps only the step counts.
    step_timing: bool = True
    # --limit-mm-per-prompt: the most images per prompt; image=0 builds the text model alone
    # (a vision-language checkpoint's vision tower is neither allocated nor read).
    limit_mm_per_prompt: MultiModalLimits = field(default_factory=MultiModalLimits)


@dataclass(slots=True)
class CacheConfig:
    # Positions per logical (hash) block, the prefix cache's granularity; None = the model's
    # default (kv_cache/groups.py default_block_size: 64, or the smallest multiple of every
    # compression ratio, 128 for DeepSeek-V4).
    block_size: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    kv_cache_memory: int | None = None       # bytes for KV on CPU; None = a default budget
    gpu_memory_utilization: float = 0.9      # fraction of free device memory on GPU
    num_blocks_override: int | None = None   # testing: exact pool size in blocks per bucket
    # How the sliding-window and compressor state is restored on a prefix hit:
    # "keep" caches the window/state blocks with the prefix; "replay" recomputes them.
    prefix_window_mode: Literal["keep", "replay"] = "keep"
    # A CPU KV pool on transparent huge pages (off: kv_cache/host_memory.py zeros says why).
    kv_huge_pages: bool = False


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None         # None = the model's limit
    long_prefill_token_threshold: int = 0    # 0 = no per-request cap below the budget
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_new_requests_per_step: int = 0       # 0 = no cap
    num_lookahead_tokens: int = 0            # speculative draft slots reserved per request
    # New prompt tokens admitted per step while running requests share it (0 = the budget);
    # why: engine/scheduler.py, "Prefill while decoding". Off by default: 512 halves TTFT p50
    # at concurrency 16 but costs P90 tok/s per user (BENCHMARKS.md, "TTFT under load").
    max_prefill_tokens_while_decoding: int = 0
    # Prompt tokens computed per step over every request still in its prompt (0 = the budget;
    # "auto": the cap that minimises a budget-filling burst's mean TTFT by the step times the
    # engine measures at start, worker/prefill_cap.py; `wideserve serve`'s default). Why:
    # engine/scheduler.py, "Prefill cap".
    max_prefill_tokens: int | Literal["auto"] = 0
    # An idle engine process woken by a request takes the ones that follow it until none came
    # for arrival_gap_ms (at most arrival_wait_max_ms; 0 = step at once), so a burst shares
    # one prefill step: engine/engine_proc.py, "Arrivals after idle".
    arrival_gap_ms: float = 3.0
    arrival_wait_max_ms: float = 30.0


@dataclass(slots=True)
class ParallelConfig:
    """Data-parallel attention + expert-parallel MoE (DEP), spelled like vLLM's flags.
    See docs/distributed.md."""
    data_parallel_size: int = 1              # engine-core ranks in the group, all nodes
    data_parallel_rank: int = 0              # this engine's rank (set per process)
    data_parallel_size_local: int | None = None   # ranks on this node (None = all)
    data_parallel_start_rank: int = 0        # first rank on this node
    data_parallel_address: str = "127.0.0.1"  # node 0's address (rendezvous, engine RPC)
    data_parallel_rpc_port: int = 29550      # rendezvous; engine sockets follow it
    enable_expert_parallel: bool = False     # shard routed experts over the ranks
    dp_sync_timeout_s: float = 120.0         # a rank silent this long fails the group
    dp_sync_method: Literal["auto", "gloo", "rd"] = "auto"   # auto = the faster, measured
    ep_dispatcher: str = "all_to_all"        # layers/ep_dispatch.py EP_DISPATCHERS
    dp_idle_poll_ms: int = 20                # idle ranks meet this often to agree on a step
    threads: int | None = None               # torch threads per engine; None = threads.py
    # A helper thread on the core the engine leaves to its front end reads the MoE weights
    # a step is about to use into the shared cache (kernels/weight_stream.py). auto: where
    # the CPU demotes lines, a core is idle, and a timed prefill step at start is faster.
    weight_streaming: Literal["auto", "on", "off"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.data_parallel_size > 1

    @property
    def local_size(self) -> int:
        return self.data_parallel_size_local or self.data_parallel_size

    def check(self) -> None:
        n = self.data_parallel_size
        if n < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {n}")
        if not 0 <= self.data_parallel_rank < n:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} outside [0, {n})")
        if not 1 <= self.local_size <= n:
            raise ValueError(f"data_parallel_size_local {self.local_size} must be in [1, {n}]")
        if not 0 <= self.data_parallel_start_rank <= n - self.local_size:
            raise ValueError(f"data_parallel_start_rank {self.data_parallel_start_rank} + "
                             f"data_parallel_size_local {self.local_size} exceeds "
                             f"data_parallel_size {n}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.weight_streaming not in ("auto", "on", "off"):
            raise ValueError(f"weight_streaming must be 'auto', 'on' or 'off', got "
                             f"{self.weight_streaming!r}")
        if self.dp_sync_timeout_s <= 0:
            raise ValueError("dp_sync_timeout_s must be positive")


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which C++ CPU ops an engine's model and sampler may run (docs/cpu_kernels.md). Every
    default is the fast path; False takes the torch reference path instead, per engine (A/B
    benchmarks, the tests of the paths CUDA runs). Where an op does not apply (another
    device or dtype, autograd, the extension not built) the torch path runs anyway."""

    cpu_norm: bool = True            # RMSNorm.cpu_kernel: the C++ norm / add+norm ops
    cpu_rope: bool = True            # llama Attention.cpu_kernel: fused q/k norm + RoPE
    cpu_gemm: bool = True            # WeightPack.cpu_kernel: the micro-kernel and brgemm GEMMs
    cpu_attention: bool = True       # PagedAttentionConfig.cpu_kernel: the paged attention op
    sdpa_prefill: bool = True        # PagedAttentionConfig.sdpa_prefill
    fused_kv_write: bool = True      # PagedAttentionConfig.fused_kv_write
    cpu_argmax: bool = True          # Sampler / Worker: greedy rows by the C++ argmax op
    # --batch-invariant: every kernel reduces in an order independent of the batch (one
    # row-invariant GEMM kernel for every token count, experts per row, fixed attention
    # tiles), so a request's greedy output is the same whatever runs beside it
    # (docs/cpu_kernels.md, "Batch invariance").
    batch_invariant: bool = False
    # --lossless-experts: the routed experts' bf16 weights held in a lossless 12-bit form
    # (3/4 of the bytes a decode step streams) where the coded op runs (AMX-BF16); greedy
    # outputs as with brgemm on the bf16 weights (docs/cpu_kernels.md, "Lossless 12-bit
    # expert weights"). "auto": where it is measured faster at start-up, and only for experts
    # larger than the last-level cache (worker/lossless_choice.py); True / False = on / off.
    lossless_experts: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        mode = self.lossless_experts
        if isinstance(mode, bool):
            object.__setattr__(self, "lossless_experts", "on" if mode else "off")
        elif mode not in ("auto", "on", "off"):
            raise ValueError(f"lossless_experts must be 'auto', 'on' or 'off' (or a bool), "
                             f"got {mode!r}")


@dataclass(slots=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None     # None = no speculative decoding
    kv_transfer: KVTransferConfig | None = None      # None = no P/D disaggregation
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eplb: EplbConfig | None = None                   # None = no expert load balancing
    kernels: KernelConfig = field(default_factory=KernelConfig)


# --- sizes with units (shared by LLM(...) keywords and the CLI's flags) ---
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
# LLM(...) keywords that take a size in bytes / a count of tokens, with or without units.
SIZE_ARGS = ("kv_cache_memory",)
COUNT_ARGS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs")


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string with units: 8589934592, '8GiB', '512MB', '4g' (k/m/g/t
    are powers of 1000, ki/mi/gi/ti of 1024; case and a trailing b ignored). A bad value is a
    ValueError naming `name`."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(value).lower()) \
            if isinstance(value, (str, float)) and not isinstance(value, bool) else None
        if match is None:
            raise ValueError(f"{name}: expected a size like 4GiB, 512MiB or a number of bytes, "
                             f"got {value!r}")
        number = int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])
    if number < 1:
        raise ValueError(f"{name}: expected a positive size, got {value!r}")
    return number


def parse_count(value: Any, name: str) -> int:
    """A positive count from an int or vLLM's --max-model-len syntax: '4096', '32k', '1M'
    (k/m/g are powers of 1000, K/M/G of 1024). A bad value is a ValueError naming `name`."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", value) \
            if isinstance(value, str) else None
        if match is None:
            raise ValueError(f"{name}: expected a positive integer like 4096 or 32k, "
                             f"got {value!r}")
        number = int(match.group(1)) * _COUNT_UNITS[match.group(2)]
    if number < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return number


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Flat keyword arguments (as `LLM(...)` takes them) -> EngineConfig; an unknown name is a
    TypeError naming it; sizes take units (`kv_cache_memory="4GiB"`, `max_model_len="32k"`),
    a bad one is a ValueError naming the argument. `speculative_config` takes a dict, a JSON string or a
    SpeculativeConfig (as vLLM's LLM does); `enable_eplb` with `eplb_config` (dict, JSON or
    EplbConfig) the same way; `kernel_config` a KernelConfig or a dict of its fields (the
    engine's CPU-op switches, e.g. {"cpu_attention": False} for an A/B run);
    `batch_invariant=True` sets KernelConfig.batch_invariant (vLLM's flag name),
    `lossless_experts` (True / False / "auto" / "on" / "off") KernelConfig.lossless_experts."""
    kernels = _kernels(kwargs.pop("kernel_config", None))
    if kwargs.pop("batch_invariant", False):
        kernels = dataclasses.replace(kernels, batch_invariant=True)
    lossless = kwargs.pop("lossless_experts", None)
    if lossless is not None:
        kernels = dataclasses.replace(kernels, lossless_experts=lossless)
    parts = {"load": LoadConfig(), "cache": CacheConfig(), "scheduler": SchedulerConfig(),
             "parallel": ParallelConfig()}
    speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
    kv_transfer = KVTransferConfig.parse(kwargs.pop("kv_transfer_config", None))
    eplb = _eplb(kwargs.pop("enable_eplb", False), kwargs.pop("eplb_config", None))
    parts["load"].limit_mm_per_prompt = MultiModalLimits.parse(  # type: ignore[attr-defined]
        kwargs.pop("limit_mm_per_prompt", None), "limit_mm_per_prompt")
    for key, value in kwargs.items():
        owner = next((p for p in parts.values() if key in p.__dataclass_fields__), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        if key in SIZE_ARGS and value is not None:
            value = parse_size(value, key)
        elif key in COUNT_ARGS and value is not None:
            value = parse_count(value, key)
        setattr(owner, key, value)
    parts["parallel"].check()  # type: ignore[attr-defined]
    return EngineConfig(**parts, speculative=speculative,  # type: ignore[arg-type]
                        kv_transfer=kv_transfer, eplb=eplb, kernels=kernels)


def _kernels(config: Any) -> KernelConfig:
    if config is None or isinstance(config, KernelConfig):
        return config or KernelConfig()
    if not isinstance(config, dict):
        raise TypeError(f"kernel_config: expected a KernelConfig or a dict, got {config!r}")
    unknown = sorted(set(config) - set(KernelConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"kernel_config: unknown field(s) {unknown}")
    return KernelConfig(**config)


def _eplb(enable: bool, config: Any) -> EplbConfig | None:
    if config is not None and not enable:
        raise ValueError("eplb_config is given but enable_eplb is not set")
    return EplbConfig.parse(config) if enable else None
