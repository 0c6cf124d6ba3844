"""Engine flags shared by `serve`, `generate` and `bench` (spelled like vLLM's), their value
parsers (a bad value is a one-line argparse error naming the flag), and the EngineConfig they
build."""
from __future__ import annotations

import argparse
from typing import Any

from wideserve.config.arg_types import (parse_bytes, parse_port, parse_positive_float,
                                        parse_positive_int)

_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
_KV_DTYPES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8",
              "fp8_e4m3": "fp8"}


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else parse_positive_int(text)


def _prefill_cap(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 0 or 'auto', got "
                                         f"{text!r}") from None


def _non_negative_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _human_int(text: str) -> int:
    """'4096', '32k', '1M' (vLLM's --max-model-len syntax: k/m are powers of 1000,
    K/M of 1024)."""
    from wideserve.config import parse_count
    try:
        return parse_count(text, "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}")
    return value


def _speculative_config(text: str) -> Any:
    """JSON like vLLM's: '{"method": "mtp", "num_speculative_tokens": 3}'."""
    from wideserve.config.speculative import SpeculativeConfig
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_transfer_config(text: str) -> Any:
    """JSON like vLLM's: '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'."""
    from wideserve.config.kv_transfer import KVTransferConfig
    try:
        return KVTransferConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-transfer-config: ")) \
            from None


def _eplb_config(text: str) -> Any:
    """JSON like vLLM's: '{"window_size": 1000, "step_interval": 3000, ...}'."""
    from wideserve.config.eplb import EplbConfig
    try:
        return EplbConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mm_limits(text: str) -> Any:
    """vLLM's forms: 'image=0' or '{"image": 0}'."""
    from wideserve.config.multimodal import MultiModalLimits
    try:
        return MultiModalLimits.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--limit-mm-per-prompt: ")) \
            from None


def one_line_error(self: argparse.ArgumentParser, message: str) -> None:
    """argparse's error() prints the whole usage block first; a bad flag is one line."""
    self.exit(2, f"{self.prog}: error: {message}\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that become the EngineConfig (shared shape with vLLM's engine args)."""
    from wideserve.entrypoints.parallel_args import add_parallel_args
    _add_model_args(parser)
    add_parallel_args(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """One "model and engine" group: what to load, how to schedule and cache, and the
    features (speculative decoding, P/D, EPLB), in this order in --help."""
    g = parser.add_argument_group("model and engine")
    _add_load_args(g)
    _add_schedule_and_cache_args(g)
    _add_feature_args(g)


def _add_load_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("model", nargs="?", default=None,
                   help="model directory or .gguf file (default: the bundled tiny model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=_DTYPES,
                   help="weight and activation dtype (auto: the config's torch_dtype; "
                        "FP8/FP4 checkpoints are dequantised to it on load)")
    g.add_argument("--load-format", default="auto",
                   choices=("auto", "safetensors", "gguf", "dummy"),
                   help="how to read the weights; dummy: random weights from config.json "
                        "alone (sizing and benchmarks)")
    g.add_argument("--seed", type=_seed, default=0,
                   help="seed for dummy weights and for sampling without a per-request seed")
    g.add_argument("--enforce-eager", default=None, action=argparse.BooleanOptionalAction,
                   help="run the model eagerly; --no-enforce-eager compiles the decoder layers "
                        "(torch.compile; attention stays eager). Default: eager on the CPU "
                        "(compiling takes tens of seconds there), compiled on other devices")
    g.add_argument("--batch-invariant", action="store_true",
                   help="outputs that do not depend on the batch: every kernel reduces in an "
                        "order independent of the batch size and a row's place in it, so "
                        "greedy outputs are bit-identical across batch mixes, data-parallel "
                        "ranks, speculation and P/D (costs speed; docs/cpu_kernels.md)")
    g.add_argument("--lossless-experts", nargs="?", const="on", default="auto",
                   choices=["auto", "on", "off"],
                   help="hold the routed experts' bf16 weights in a lossless 12-bit form (3/4 "
                        "of the bytes each decode step reads; decoded in the fused op, outputs "
                        "as on the bf16 weights). CPUs with AMX-BF16; 'on' (the flag alone) "
                        "elsewhere warns and keeps bf16; 'auto' (default) codes them where a "
                        "start-up timing finds it faster, for experts larger than the "
                        "last-level cache (docs/cpu_kernels.md)")
    g.add_argument("--small-batch-gemms", default=True, action=argparse.BooleanOptionalAction,
                   help="decode steps of 1-4 requests run DeepSeek-V4 / V4.1's plain linears "
                        "through the small-M GEMM kernel (faster; in bf16 a value may round "
                        "one ulp apart from the standard path's). --no-small-batch-gemms "
                        "keeps F.linear; never used with --batch-invariant (docs/host_path.md)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=parse_positive_int, default=None,
                   help="torch threads per engine process (default: one per core this "
                        "process may use, less one for the server's front end, split over "
                        "data-parallel ranks, each rank bound to its cores; "
                        "$OMP_NUM_THREADS also sets it)")
    g.add_argument("--weight-streaming", choices=("auto", "on", "off"), default="auto",
                   help="a helper thread on the core left to the front end reads the MoE "
                        "weights a step is about to use into the shared cache (auto: where "
                        "the CPU has CLDEMOTE, a core is idle and a timed step at start is "
                        "faster; docs/cpu_kernels.md, \"Weight streaming\")")


def _add_schedule_and_cache_args(g: argparse._ArgumentGroup) -> None:
    from wideserve.config import SchedulerConfig
    g.add_argument("--max-model-len", type=_human_int, default=None,
                   help="longest prompt + output in tokens, e.g. 4096 or 32k (default: the "
                        "model's limit)")
    g.add_argument("--max-num-seqs", type=parse_positive_int, default=64,
                   help="requests running at once (per data-parallel rank)")
    g.add_argument("--max-num-batched-tokens", type=parse_positive_int, default=2048,
                   help="tokens per engine step; longer prompts are prefilled in chunks")
    g.add_argument("--max-prefill-tokens-while-decoding", type=_non_negative_int,
                   default=SchedulerConfig().max_prefill_tokens_while_decoding,
                   help="new prompt tokens admitted per step while running requests share "
                        "it (0: the whole budget left); see engine/scheduler.py")
    g.add_argument("--max-prefill-tokens", type=_prefill_cap, default=0,
                   help="prompt tokens per engine step over all prompts being prefilled: N, "
                        "0 (the whole budget) or auto (measured at start: the cap that "
                        "returns a burst's first tokens soonest on average; the default of "
                        "`serve`, 0 elsewhere); see engine/scheduler.py")
    g.add_argument("--arrival-gap-ms", type=_non_negative_ms,
                   default=SchedulerConfig().arrival_gap_ms,
                   help="an idle engine woken by a request waits for the ones that follow "
                        "it until none came for this long, so a burst shares one prefill "
                        "step (0: step at once); see engine/engine_proc.py")
    g.add_argument("--arrival-wait-max-ms", type=_non_negative_ms,
                   default=SchedulerConfig().arrival_wait_max_ms,
                   help="the longest such wait after idle (0: step at once)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   help="admission order: first come first served, or the request's "
                        "'priority' field (lower first)")
    g.add_argument("--block-size", type=parse_positive_int, default=None,
                   help="positions per KV block, the prefix cache's granularity (default: "
                        "the model's: 64, or 128 for DeepSeek-V4, whose compression ratios "
                        "4 and 128 it must be a multiple of)")
    g.add_argument("--enable-prefix-caching", default=True,
                   action=argparse.BooleanOptionalAction,
                   help="reuse the KV of shared prompt prefixes across requests (default on)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=tuple(_KV_DTYPES),
                   help="KV record format: auto (the model dtype), bf16, or fp8 (DeepSeek "
                        "FP8 latents + MXFP4 indexer keys; bytes per token: `wideserve info "
                        "MODEL --kv-cache-dtype fp8`)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 4GiB (default: sized automatically)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="CUDA only: fraction of free device memory for weights, activations "
                        "and KV (default 0.9)")
    g.add_argument("--generation-config", default="auto",
                   help="'auto' (the model's generation_config.json), 'vllm' or 'none' "
                        "(ignore it), or a directory holding one")


def _add_feature_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None,
                   help="most images per prompt, as image=N or JSON '{\"image\": N}' "
                        "(default 999); image=0 loads a vision-language checkpoint's text "
                        "model alone, without its vision tower")
    g.add_argument("--decoder-bounded-replay", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="DeepSeek-V4.1: the last KV source and the layers after it run only "
                        "on the rows whose results are read (exact; faster long prefills). "
                        "Default: on for V4.1, where it applies; --no-decoder-bounded-replay "
                        "turns it off; the flag on another model is an error "
                        "(docs/deepseek_v41.md)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "mtp", '
                        '"num_speculative_tokens": 3}\'; methods mtp, ngram '
                        '(prompt_lookup_min/max), draft_model (model); '
                        '"forced_acceptance_length" is for benchmarks only (outputs are then '
                        'not the model\'s)')
    g.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   help='P/D disaggregation as JSON, e.g. \'{"kv_connector": "NixlConnector", '
                        '"kv_role": "kv_producer"}\' (kv_producer | kv_consumer | kv_both); '
                        'the side-channel secret comes from $WIDESERVE_KV_SECRET '
                        '(docs/disaggregation.md)')
    g.add_argument("--enable-eplb", action="store_true",
                   help="expert-parallel load balancing: record expert loads, replicate hot "
                        "experts into redundant slots, rebalance periodically (docs/eplb.md)")
    g.add_argument("--eplb-config", type=_eplb_config, default=None,
                   help='EPLB settings as JSON, e.g. \'{"window_size": 1000, "step_interval": '
                        '3000, "num_redundant_experts": 32, "log_balancedness": true}\'')


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """`wideserve serve`'s per-request limits (docs/server_reliability.md, "Request limits"),
    the fields of serving/openai/limits.py's RequestLimits (its defaults)."""
    from wideserve.serving.openai.limits import RequestLimits
    d = RequestLimits()
    g = parser.add_argument_group("request limits (400 beyond each, 431 for headers)")
    for flag, default, what in (
            ("--max-tools", d.max_tools, "tool definitions in one request"),
            ("--max-tools-bytes", d.max_tools_bytes, "bytes of JSON of all `tools`"),
            ("--max-schema-bytes", d.max_schema_bytes, "bytes of JSON of one output "
             "constraint (schema, regex, grammar, choices)"),
            ("--max-schema-depth", d.max_schema_depth, "nesting levels of a JSON schema"),
            ("--max-logit-bias", d.max_logit_bias, "logit_bias entries"),
            ("--max-messages", d.max_messages, "chat messages (Responses input items)"),
            ("--max-stop", d.max_stop, "stop strings"),
            ("--max-stop-chars", d.max_stop_chars, "characters of one stop string"),
            ("--max-header-bytes", d.max_header_bytes, "bytes of a request's line and "
             "headers"),
            ("--request-prep-workers", d.prep_workers, "threads preparing requests off the "
             "event loop (validation, templates, output constraints)")):
        g.add_argument(flag, type=parse_positive_int, default=default,
                       help=f"most {what} (default {default})")
    g.add_argument("--request-prep-timeout", type=parse_positive_float,
                   default=d.prep_timeout_s, help="seconds a request's preparation may take "
                   f"before it is answered 503 (default {d.prep_timeout_s:g})")
    g.add_argument("--log-request-content", action="store_true",
                   help="log each request's end user and prompt at debug level (off: ids "
                        "and sizes only)")


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from wideserve.config import (CacheConfig, EngineConfig, KernelConfig, LoadConfig,
                                  SchedulerConfig)
    from wideserve.entrypoints.parallel_args import parallel_config_from_args
    parallel = parallel_config_from_args(args)
    parallel.threads = getattr(args, "threads", None)
    parallel.weight_streaming = getattr(args, "weight_streaming", "auto")
    return EngineConfig(
        load=LoadConfig(model=args.model, dtype=args.dtype, load_format=args.load_format,
                        seed=args.seed, device=_resolve_device(args.device),
                        tokenizer=args.tokenizer, enforce_eager=args.enforce_eager,
                        decoder_bounded_replay=getattr(args, "decoder_bounded_replay", None),
                        limit_mm_per_prompt=_mm_or_default(args),
                        small_batch_gemms=getattr(args, "small_batch_gemms", True)),
        cache=CacheConfig(block_size=args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=_KV_DTYPES[args.kv_cache_dtype],  # type: ignore[arg-type]
                          kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_prefill_tokens_while_decoding=getattr(
                                      args, "max_prefill_tokens_while_decoding", 0),
                                  max_prefill_tokens=getattr(args, "max_prefill_tokens", 0),
                                  max_model_len=args.max_model_len,
                                  policy=args.scheduling_policy,
                                  **_arrival_window(args)),
        speculative=getattr(args, "speculative_config", None),
        kv_transfer=getattr(args, "kv_transfer_config", None),
        eplb=_eplb_from_args(args),
        parallel=parallel,
        kernels=KernelConfig(batch_invariant=getattr(args, "batch_invariant", False),
                             lossless_experts=getattr(args, "lossless_experts", "auto")),
    )


def _arrival_window(args: argparse.Namespace) -> dict[str, float]:
    """The flags where the command has them (`wideserve serve`), else SchedulerConfig's."""
    return {k: getattr(args, k) for k in ("arrival_gap_ms", "arrival_wait_max_ms")
            if getattr(args, k, None) is not None}


def _mm_or_default(args: argparse.Namespace) -> Any:
    from wideserve.config.multimodal import MultiModalLimits
    return getattr(args, "limit_mm_per_prompt", None) or MultiModalLimits()


def _eplb_from_args(args: argparse.Namespace) -> Any:
    from wideserve.config.eplb import EplbConfig
    config = getattr(args, "eplb_config", None)
    if config is not None and not getattr(args, "enable_eplb", False):
        raise ValueError("--eplb-config is given without --enable-eplb")
    return (config or EplbConfig()) if getattr(args, "enable_eplb", False) else None


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
