"""`wideserve info MODEL_DIR`: what a model is and what it costs to serve, from config.json alone.

The model is built on the meta device (no weights, no memory), so this works for a 284B
checkpoint directory that holds only its config. Printed: architecture, parameters (total and
active per token), the layer schedule (attention kind per layer from the model's KV cache specs,
MoE kind from its parameters; repeated and alternating runs compressed), and KV cache bytes per
token of context and bounded bytes per request, per cache role and in total.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

from wideserve.entrypoints.engine_args import _fraction, _human_int
from wideserve.config.arg_types import parse_bytes, parse_positive_int

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
DTYPES = ("auto", "bfloat16", "float16", "float32")
_LAYER_RE = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.")
_ONE_MILLION = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "info", help="describe a model: parameters, layer schedule, KV cache bytes per token",
        description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="directory with config.json (default: the bundled tiny model)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV record format: auto (= model dtype), bf16, or fp8 "
                        "(FP8 latents + MXFP4 indexer keys)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weight dtype (auto = config torch_dtype)")
    g = p.add_argument_group("--plan: memory per rank for a deployment (an estimate)")
    g.add_argument("--plan", action="store_true",
                   help="size a deployment: weights per rank, KV per request, KV capacity "
                        "left per rank, fewest DEP ranks")
    g.add_argument("--data-parallel-size", "-dp", type=parse_positive_int, default=1,
                   help="ranks (GPUs or CPU engine processes) of the deployment")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over the ranks (DEP)")
    g.add_argument("--memory-per-rank", type=parse_bytes, default=None,
                   help="device memory of one rank, e.g. 141GiB (H200), 80GiB (H100)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="the fraction of it wideserve may use (default 0.9)")
    g.add_argument("--max-model-len", type=_human_int, default=None,
                   help="context per request, e.g. 128k (default: the model's limit)")
    g.add_argument("--max-num-seqs", type=parse_positive_int, default=64,
                   help="requests running at once per rank (their windows are reserved)")
    g.add_argument("--max-num-batched-tokens", type=parse_positive_int, default=2048,
                   help="tokens of the largest step (sizes the activation reserve)")
    g.add_argument("--num-redundant-experts", type=_non_negative_int, default=0,
                   help="EPLB replicas per MoE layer over all ranks (with "
                        "--enable-expert-parallel)")
    g.add_argument("--speculative", action="store_true",
                   help="count the drafter's KV cache too (MTP / DSpark)")
    p.add_argument("--kernels", action="store_true",
                   help="also print the GEMM kernel chosen per family and token bucket on "
                        "this machine, with the measured times (timed now if not cached)")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        text = describe_model(args.model, args.kv_cache_dtype, args.dtype,
                              plan=_plan_inputs(args) if args.plan else None,
                              kernels=args.kernels)
    except (FileNotFoundError, ValueError) as exc:
        print(f"wideserve info: error: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


# --- formatting helpers ---

def _num(x: float) -> str:
    """Thousands separators; whole bytes from 100 up (3,514), two decimals below (4.56)."""
    if x >= 100 or float(x).is_integer():
        return f"{x:,.0f}"
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{_num(n)} B"


def _count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f}{unit})"
    return f"{n:,}"


def compress_runs(labels: list[str], first: int = 0, noun: str = "layer") -> list[str]:
    """Per-layer labels -> lines like "layers 2-42: CSA(4)/HCA(128) alternating"."""
    lines: list[str] = []
    i, n = 0, len(labels)
    while i < n:
        j = i + 1
        while j < n and labels[j] == labels[i]:
            j += 1
        text = labels[i]
        if j == i + 1 and i + 3 < n and labels[i + 1] != labels[i]:
            k = i + 2
            while k < n and labels[k] == labels[k - 2]:
                k += 1
            if k - i >= 4:                       # at least two full periods
                j, text = k, f"{labels[i]}/{labels[i + 1]} alternating"
        span = f"{noun} {first + i}" if j == i + 1 else f"{noun}s {first + i}-{first + j - 1}"
        lines.append(f"{span}: {text}")
        i = j
    return lines


# --- what the model says about itself ---

def _block_of(name: str) -> tuple[str, int] | None:
    m = _LAYER_RE.match(name)
    return (m[1], int(m[2])) if m else None


def attention_labels(specs: dict) -> dict[tuple[str, int], str]:
    """(block kind, index) -> "SWA(128)" / "CSA(4)" / "HCA(128)" / "full", from cache specs."""
    from wideserve.kv_cache.spec import SharedKVSpec   # torch: not at --help time
    by_block: dict[tuple[str, int], list] = defaultdict(list)
    reads: dict[tuple[str, int], str] = {}
    for name, spec in specs.items():
        block = _block_of(name)
        if block is None:
            continue
        if isinstance(spec, SharedKVSpec):   # reads another layer's records (V4.1 reuse)
            reads[block] = spec.owner
        else:
            by_block[block].append(spec)
    labels = {}
    for block, block_specs in by_block.items():
        if block in reads:
            owner = reads[block]
            labels[block] = (f"CSA({specs[owner].compress_ratio}) reads layer "
                             f"{_block_of(owner)[1]}")
            continue
        roles = {s.role: s for s in block_specs}
        if "compressed" in roles:
            kind = "CSA" if "indexer" in roles else "HCA"
            labels[block] = f"{kind}({roles['compressed'].compress_ratio})"
        elif any(s.grows_with_context for s in block_specs):
            labels[block] = "full"
        else:
            labels[block] = f"SWA({max(s.window for s in block_specs)})"
    return labels


def mlp_labels(model, config_json: dict) -> dict[tuple[str, int], str]:
    """(block kind, index) -> "hash MoE" / "top-k MoE" / "dense MLP", from parameter names."""
    kinds: dict[tuple[str, int], set[str]] = defaultdict(set)
    for name in model.state_dict(keep_vars=True):
        block = _block_of(name)
        if block is None or (".mlp." not in name and ".ffn." not in name):
            continue
        if name.endswith("gate.tid2eid"):
            kinds[block].add("hash")
        elif ".experts." in name:
            kinds[block].add("experts")
        else:
            kinds[block].add("dense")
    k = config_json.get("num_experts_per_tok")
    e = (config_json.get("n_routed_experts") or config_json.get("num_experts")
         or config_json.get("num_local_experts"))
    sizes = f" ({k} of {e})" if k and e else ""
    return {b: ("hash MoE" if "hash" in s else "top-k MoE" if "experts" in s else "dense MLP")
            + (sizes if "experts" in s else "") for b, s in kinds.items()}


def _schedule_lines(specs: dict, model, config_json: dict) -> list[str]:
    attn, mlp = attention_labels(specs), mlp_labels(model, config_json)
    blocks = sorted(set(attn) | set(mlp), key=lambda b: (b[0] != "layers", b[1]))
    lines = []
    for kind, title, noun in (("layers", "layers", "layer"), ("mtp", "MTP blocks", "block")):
        idx = [b[1] for b in blocks if b[0] == kind]
        if not idx:
            continue
        lines.append(f"{title} ({len(idx)}):")
        for what, table in (("attention", attn), ("mlp", mlp)):
            labels = [table.get((kind, i), "-") for i in idx]
            lines += [f"  {what:9s} {line}" for line in compress_runs(labels, idx[0], noun)]
    return lines


def _kv_lines(specs: dict, mtp_specs: dict, kv_cache_dtype: str) -> list[str]:
    from wideserve.kv_cache.spec import split_shared
    per_token: dict[str, float] = defaultdict(float)
    bounded: dict[str, int] = defaultdict(int)
    specs, shared = split_shared(specs)
    for spec in specs.values():
        per_token[spec.role] += spec.bytes_per_token
        bounded[spec.role] += spec.bounded_bytes
    total_tok, total_bounded = sum(per_token.values()), sum(bounded.values())
    lines = [f"KV cache (--kv-cache-dtype {kv_cache_dtype}; {len(specs)} caches):",
             f"  {'role':14s} {'B/token of context':>20s} {'bounded B/request':>20s}"]
    for role in sorted(per_token, key=lambda r: (-per_token[r], -bounded[r], r)):
        lines.append(f"  {role:14s} {_num(per_token[role]):>20s} {_num(bounded[role]):>20s}")
    lines.append(f"  {'total':14s} {_num(total_tok):>20s} {_num(total_bounded):>20s}")
    lines.append(f"  total KV per token: {_num(total_tok)} B; per request: {_bytes(total_bounded)} "
                 f"bounded + {_bytes(total_tok * _ONE_MILLION)} at {_ONE_MILLION:,} tokens")
    if shared:
        lines.append(f"  {len(shared)} more caches read other layers' records "
                     f"(cross-layer sharing: stored and counted once)")
    if mtp_specs:
        mtp_bounded = sum(s.bounded_bytes for s in mtp_specs.values())
        mtp_tok = sum(s.bytes_per_token for s in mtp_specs.values())
        lines.append(f"  MTP blocks (speculative decoding) add {_num(mtp_tok)} B/token and "
                     f"{_num(mtp_bounded)} B/request bounded")
    return lines


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _plan_inputs(args: argparse.Namespace) -> dict:
    return {"ranks": args.data_parallel_size, "expert_parallel": args.enable_expert_parallel,
            "memory_per_rank": args.memory_per_rank, "utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_redundant_experts": args.num_redundant_experts,
            "speculative": args.speculative}


def describe_model(model_dir: str | None, kv_cache_dtype: str = "auto",
                   dtype: str = "auto", plan: dict | None = None,
                   kernels: bool = False) -> str:
    import torch

    from wideserve.worker.model_loader import (build_model, read_config, resolve_dtype,
                                               resolve_model_path)
    from wideserve.models.registry import resolve_model_class

    path = resolve_model_path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: `wideserve info` needs a model directory with config.json")
    config_json = read_config(path)
    cls = resolve_model_class(config_json)
    wdtype = resolve_dtype(dtype, config_json)
    model = build_model(cls, cls.config_class.from_dict(config_json), wdtype,
                        torch.device("meta"))
    total, active = model.param_counts()
    specs = model.kv_cache_specs(kv_cache_dtype)
    mtp_specs = model.mtp_kv_cache_specs(kv_cache_dtype)
    arch = (config_json.get("architectures") or [cls.__name__])[0]
    lines = [f"model:        {Path(path)}",
             f"architecture: {arch} (model_type {config_json.get('model_type', '?')})",
             f"dtype:        {str(wdtype).removeprefix('torch.')}{_quant_note(config_json)}",
             f"parameters:   {_count(total)} total, {_count(active)} active per token"]
    if model.mtp_param_counts()[0]:
        mtp_total, mtp_active = model.mtp_param_counts()
        lines.append(f"MTP blocks:   {_count(mtp_total)} total, {_count(mtp_active)} active "
                     "per token (embedding and lm_head shared)")
    vision = model.vision_param_count()
    if vision:
        lines.append(f"vision tower: {_count(vision)} (once per image; not in the counts above)")
    lines.append("")
    lines += _schedule_lines({**specs, **mtp_specs}, model, config_json)
    lines += [""] + _kv_lines(specs, mtp_specs, kv_cache_dtype)
    if plan is not None:
        lines += [""] + _plan(model, specs, config_json, plan, wdtype, kv_cache_dtype)
    if kernels:          # layers/kernel_table.py: measured on this machine, cached on disk
        from wideserve.layers.kernel_table import kernel_table_lines
        lines += [""] + kernel_table_lines(model, wdtype)
    return "\n".join(lines)


def _plan(model, specs: dict, config_json: dict, plan: dict, wdtype, kv_cache_dtype: str
          ) -> list[str]:
    from wideserve.entrypoints.plan import (CHECKPOINT_EXPERT_BYTES, PlanInputs,
                                            activation_reserve, activation_shape,
                                            engine_kv_sizes, plan_lines, weight_bytes)
    from wideserve.worker.weights import keeps_expert_format
    plan = dict(plan)
    tokens = plan.pop("max_num_batched_tokens", 2048)
    if plan.pop("speculative", False):
        specs = {**specs, **_draft_specs(model, kv_cache_dtype)}
    limit = int(config_json.get("max_position_embeddings")
                or (config_json.get("text_config") or {}).get("max_position_embeddings")
                or 0) or None
    inputs = PlanInputs(**{**plan, "max_model_len": plan["max_model_len"] or limit or 4096})
    if limit and inputs.max_model_len > limit:
        raise ValueError(f"--max-model-len {inputs.max_model_len} exceeds the model's limit "
                         f"of {limit} positions")
    w = weight_bytes(model)
    if inputs.num_redundant_experts and not inputs.expert_parallel:
        raise ValueError("--num-redundant-experts needs --enable-expert-parallel")
    per_token, bounded = engine_kv_sizes(specs, inputs.max_num_seqs, tokens)
    inputs.reserve = activation_reserve(activation_shape(model.config), tokens,
                                        inputs.max_num_seqs, wdtype.itemsize)
    inputs.checkpoint_experts, inputs.format_assumed = _expert_format(config_json)
    if inputs.checkpoint_experts in CHECKPOINT_EXPERT_BYTES and keeps_expert_format(config_json):
        inputs.experts_kept, inputs.dense_experts = True, w.experts
        w = w.with_experts_as(inputs.checkpoint_experts)
    return plan_lines(w, per_token, bounded, inputs, str(wdtype).removeprefix("torch."),
                      kv_cache_dtype)


def _draft_specs(model, kv_cache_dtype: str) -> dict:
    """The drafter's KV specs, as spec_decode/dspark.py and spec_decode/mtp.py add them
    (the model contract says which drafter the model has: models/interface.py)."""
    if model.num_mtp_blocks:
        if model.supports_dspark:
            specs = model.dspark_kv_cache_specs(kv_cache_dtype)
        else:                                      # one MTP block drafts (spec_decode/mtp.py)
            specs = {n: s for n, s in model.mtp_kv_cache_specs(kv_cache_dtype).items()
                     if n.startswith("mtp.0.")}
        if specs:
            return specs
    raise ValueError("--speculative: this model has no drafter (MTP / DSpark blocks)")


# Routed-expert formats of released checkpoints whose config.json names none: DeepSeek-V4.1's
# experts are MXFP4 (e2m1 + UE8M0 per 32) as V4's (docs/sizing.md).
RELEASED_EXPERT_FORMAT = {"deepseek_v41": "fp4"}


def _expert_format(config_json: dict) -> tuple[str | None, bool]:
    """(the checkpoint's routed-expert format, whether it is the family's released format
    assumed because config.json names none): `expert_dtype`, ModelOpt NVFP4, or a block-wise
    FP8 checkpoint without FP4 experts (HF / vLLM FP8, DeepSeek "FP8 mixed" bases)."""
    text = config_json.get("text_config") or {}
    qc = config_json.get("quantization_config") or text.get("quantization_config") or {}
    fmt = config_json.get("expert_dtype") or text.get("expert_dtype") or qc.get("expert_dtype")
    if fmt:
        return str(fmt).lower(), False
    if qc.get("quant_method") == "modelopt" and qc.get("quant_algo") == "NVFP4":
        return "nvfp4", False
    if qc.get("quant_method") == "fp8":
        return "fp8", False
    released = RELEASED_EXPERT_FORMAT.get(config_json.get("model_type"))
    return released, released is not None


def _quant_note(config_json: dict) -> str:
    qc = config_json.get("quantization_config")
    if not qc:
        return ""
    block = qc.get("weight_block_size")
    experts = config_json.get("expert_dtype", qc.get("expert_dtype"))
    return (f" (checkpoint: {qc.get('quant_method')} {qc.get('fmt', '')}"
            f"{f' blocks {block[0]}x{block[1]}' if block else ''}"
            f"{f', experts {experts}' if experts else ''}; routed experts kept in that format "
            f"where the loader stacks them, the rest dequantised on load)")
