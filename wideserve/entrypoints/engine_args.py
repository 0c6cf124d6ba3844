"""Engine flags shared by `serve`, `generate` and `bench` (spelled like vLLM's), their value
parsers (a bad value is a one-line argparse error naming the flag), and the EngineConfig they
build."""
from __future__ import annotations

import argparse
import re
from typing import Any

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
_KV_DTYPES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8",
              "fp8_e4m3": "fp8"}


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_port(text: str) -> int:
    value = parse_positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}")
    return value


def _human_int(text: str) -> int:
    """'4096', '32k', '1M' (vLLM's --max-model-len syntax: k/m are powers of 1000,
    K/M of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a positive integer like 4096 or 32k, "
                                         f"got {text!r}")
    number, unit = int(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
             "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    if number * scale < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return number * scale


def parse_bytes(text: str) -> int:
    """'8589934592', '8GiB', '512MB', '4g' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 512MB, got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


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
    from wideserve.spec_decode.config import SpeculativeConfig
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_transfer_config(text: str) -> Any:
    """JSON like vLLM's: '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'."""
    from wideserve.disagg.config import KVTransferConfig
    try:
        return KVTransferConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-transfer-config: ")) \
            from None


def _eplb_config(text: str) -> Any:
    """JSON like vLLM's: '{"window_size": 1000, "step_interval": 3000, ...}'."""
    from wideserve.distributed.eplb.config import EplbConfig
    try:
        return EplbConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def one_line_error(self: argparse.ArgumentParser, message: str) -> None:
    """argparse's error() prints the whole usage block first; a bad flag is one line."""
    self.exit(2, f"{self.prog}: error: {message}\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that become the EngineConfig (shared shape with vLLM's engine args)."""
    from wideserve.distributed.args import add_parallel_args
    _add_model_args(parser)
    add_parallel_args(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("model", nargs="?", default=None,
                   help="model directory or .gguf file (default: the bundled tiny model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=_DTYPES)
    g.add_argument("--load-format", default="auto",
                   choices=("auto", "safetensors", "gguf", "dummy"))
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--enforce-eager", default=None, action=argparse.BooleanOptionalAction,
                   help="run the model eagerly; --no-enforce-eager compiles the decoder layers "
                        "(torch.compile; attention stays eager). Default: eager on the CPU "
                        "(compiling takes tens of seconds there), compiled on other devices")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=parse_positive_int, default=None,
                   help="torch threads per engine process (default: one per core this "
                        "process may use, less one for the server's front end, split over "
                        "data-parallel ranks, each rank bound to its cores; "
                        "$OMP_NUM_THREADS also sets it)")
    g.add_argument("--max-model-len", type=_human_int, default=None)
    g.add_argument("--max-num-seqs", type=parse_positive_int, default=64)
    g.add_argument("--max-num-batched-tokens", type=parse_positive_int, default=2048)
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    g.add_argument("--block-size", type=parse_positive_int, default=None,
                   help="positions per KV block, the prefix cache's granularity (default: "
                        "the model's: 64, or 128 for DeepSeek-V4, whose compression ratios "
                        "4 and 128 it must be a multiple of)")
    g.add_argument("--enable-prefix-caching", default=True,
                   action=argparse.BooleanOptionalAction)
    g.add_argument("--kv-cache-dtype", default="auto", choices=tuple(_KV_DTYPES))
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 4GiB (default: sized automatically)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    g.add_argument("--generation-config", default="auto",
                   help="'auto' (the model's generation_config.json), 'vllm' or 'none' "
                        "(ignore it), or a directory holding one")
    g.add_argument("--decoder-bounded-replay", action="store_true",
                   help="DeepSeek-V4.1 only, approximate (off by default): layers after the "
                        "last KV source run only on each prefill chunk's last sliding-window "
                        "rows; faster long prefills, outputs may differ; no prompt logprobs "
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


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from wideserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
    from wideserve.distributed.args import parallel_config_from_args
    parallel = parallel_config_from_args(args)
    parallel.threads = getattr(args, "threads", None)
    return EngineConfig(
        load=LoadConfig(model=args.model, dtype=args.dtype, load_format=args.load_format,
                        seed=args.seed, device=_resolve_device(args.device),
                        tokenizer=args.tokenizer, enforce_eager=args.enforce_eager,
                        decoder_bounded_replay=getattr(args, "decoder_bounded_replay", False)),
        cache=CacheConfig(block_size=args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=_KV_DTYPES[args.kv_cache_dtype],  # type: ignore[arg-type]
                          kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len,
                                  policy=args.scheduling_policy),
        speculative=getattr(args, "speculative_config", None),
        kv_transfer=getattr(args, "kv_transfer_config", None),
        eplb=_eplb_from_args(args),
        parallel=parallel,
    )


def _eplb_from_args(args: argparse.Namespace) -> Any:
    from wideserve.distributed.eplb.config import EplbConfig
    config = getattr(args, "eplb_config", None)
    if config is not None and not getattr(args, "enable_eplb", False):
        raise ValueError("--eplb-config is given without --enable-eplb")
    return (config or EplbConfig()) if getattr(args, "enable_eplb", False) else None


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
