"""The block `wideserve serve` prints once the engine is up: what is served, on what, with
which features, and where. One place so that every setting a user asks about after the fact
("is MTP on? how many requests fit?") is in the log of the run.

    wideserve | model:      DeepSeek-V4-Flash (DeepseekV4ForCausalLM, bfloat16, cpu)
    wideserve | parameters: 13.76B on each rank: its 1/8 of the routed experts + the rest
    wideserve | parallel:   DEP, 8 ranks (this node: ranks 0-7), experts sharded ...
    wideserve | context:    131072 tokens per request at most (prompt + output, ...)
    wideserve | KV cache:   1,114,112 tokens of context per rank, shared by its running requests
    wideserve |             = 8 requests at the full 131,072-token context; ...
    wideserve | features:   MTP speculation k=3; EPLB every 3000 steps ...; P/D off; ...
    wideserve | kernels:    C++ CPU kernels, avx512bf16 build (installed); CPU features: ...
    wideserve |             GEMM kernel per token bucket (1 thread; the kernel's us at ...)
    wideserve |               linear      4096x128  micro 1, brgemm 2-16, onednn 17+  (13 ...)
    wideserve | serving:    http://127.0.0.1:8000/v1 as "DeepSeek-V4-Flash" ...
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from wideserve.kernels import describe

PREFIX = "wideserve | "


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def startup_summary(info: dict[str, Any], config: Any, served_names: list[str],
                    max_model_len: int, url: str, kernels: list[str] | None = None) -> str:
    """The block as text, every line prefixed with PREFIX."""
    lines = [f"model:      {served_names[0]} ({info.get('architecture', '?')}, "
             f"{info.get('dtype', '?')}, {config.load.device})"
             f"{_source(config.load.model)}",
             f"parameters: {_params(info, config.parallel)}",
             f"parallel:   {_parallel(config.parallel, config.load.device)}",
             f"context:    {max_model_len} tokens per request at most (prompt + output, "
             f"--max-model-len)",
             *_kv(info, config, max_model_len),
             f"features:   {features(config)}"]
    # The engine's own report (its build, and the GEMM kernel it measured fastest per family,
    # shape and token bucket: engine/engine_core.py ModelInfo.kernels); this process's view of
    # the build where an engine sent none.
    kernel_lines = kernels if kernels is not None else \
        list(info.get("kernels") or [describe(config.load.device)])
    for i, line in enumerate(kernel_lines):
        lines.append(f"{'kernels:' if i == 0 else '':12s}{line}")
    also = f" (also {', '.join(served_names[1:])})" if len(served_names) > 1 else ""
    lines.append(f"serving:    {url}/v1 as \"{served_names[0]}\"{also}; health {url}/health, "
                 f"metrics {url}/metrics")
    return "\n".join(PREFIX + line for line in lines)


def _source(model: str | None) -> str:
    return " from the package" if model is None else f" from {Path(model).expanduser()}"


def _params(info: dict[str, Any], parallel: Any) -> str:
    total = fmt_count(int(info.get("num_params", 0)))
    active = fmt_count(int(info.get("num_active_params", 0)))
    if parallel.enabled and parallel.enable_expert_parallel:
        # Each rank built only its share of the routed experts: its count is not the model's.
        return (f"{total} on each rank (rank 0's count: its 1/{parallel.data_parallel_size} "
                f"of the routed experts and a full copy of everything else)")
    copies = f"; a full copy on each of {parallel.data_parallel_size} ranks" \
        if parallel.enabled else ""
    return f"{total} total, {active} active per token{copies}"


def _parallel(parallel: Any, device: str) -> str:
    if not parallel.enabled:
        return f"one engine on {device}"
    n, local = parallel.data_parallel_size, parallel.local_size
    first = parallel.data_parallel_start_rank
    here = f"ranks {first}-{first + local - 1}" if local > 1 else f"rank {first}"
    kind = "DEP (data-parallel attention, expert-parallel MoE)" \
        if parallel.enable_expert_parallel else "data parallel (full model per rank)"
    return (f"{kind}, {n} ranks; this node runs {here} on {device}, node 0 at "
            f"{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}; lock-step "
            f"sync {parallel.dp_sync_method}; each rank has its own requests and KV cache")


def _kv(info: dict[str, Any], config: Any, max_model_len: int) -> list[str]:
    cap = info.get("kv_capacity_tokens")
    block = info.get("kv_block_size")
    scope = "per rank" if config.parallel.enabled else "in total"
    caching = "on" if config.cache.enable_prefix_caching else "off"
    tail = (f"{f'{block}-token blocks, ' if block else ''}prefix caching {caching}, "
            f"KV dtype {config.cache.kv_cache_dtype}")
    if cap is None:
        return [f"KV cache:   sliding windows only (no cache grows with context); {tail}"]
    full = int(cap) // max(1, max_model_len)
    seqs = config.scheduler.max_num_seqs
    return [f"KV cache:   {int(cap):,} tokens of context {scope}, shared by all running "
            f"requests (capacity, not a context length)",
            f"            = room for {full:,} requests at the full {max_model_len:,}-token "
            f"context; at most {seqs} run at once (--max-num-seqs); {tail}"]


def features(config: Any) -> str:
    """Active features and their settings, ';'-separated; every one says on or off."""
    spec = config.speculative
    if spec is None:
        spec_text = "speculative decoding off"
    else:
        spec_text = {"mtp": "MTP speculation", "dspark": "DSpark speculation",
                     "ngram": "n-gram speculation", "draft_model": "draft-model speculation"
                     }.get(spec.method, f"{spec.method} speculation")
        spec_text += f" k={spec.num_speculative_tokens}"
        if spec.method == "ngram":
            spec_text += f" (n {spec.prompt_lookup_min}-{spec.prompt_lookup_max})"
        if spec.method == "draft_model":
            spec_text += f" ({spec.model})"
    eplb = config.eplb
    eplb_text = "EPLB off" if eplb is None else (
        f"EPLB every {eplb.step_interval} steps over a {eplb.window_size}-step window, "
        f"{eplb.num_redundant_experts} redundant experts")
    kv = config.kv_transfer
    pd_text = "P/D off" if kv is None else (
        f"P/D {kv.kv_role} over {kv.kv_connector} ({kv.kv_transfer_op})")
    caching = "prefix caching " + ("on" if config.cache.enable_prefix_caching else "off")
    eager = config.load.enforce_eager
    compiled = "eager" if eager or (eager is None and config.load.device == "cpu") \
        else "torch.compile"
    return "; ".join((spec_text, eplb_text, pd_text, caching, compiled))
