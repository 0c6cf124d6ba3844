"""Build a model from a checkpoint directory, a GGUF file, or its config alone (dummy weights).

`load_model(LoadConfig)` resolves the path (None = the bundled tiny model), reads config.json,
picks the class through the registry, builds the module directly on the target device with its
parameters in the load dtype (parameters the model creates with an explicit dtype, like
DeepSeek-V4's fp32 norms and mHC weights, keep it), fills them, and checks that every parameter
and persistent buffer was filled.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from wideserve.config import LoadConfig
from wideserve.worker.dummy_weights import init_dummy_weights
from wideserve.worker.weights import CheckpointReader, checkpoint_expert_format
from wideserve.layers.engram import HostResident
from wideserve.models.interface import CausalLM
from wideserve.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "shakespeare-v4-tiny"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
# Checkpoint tensors no wideserve model consumes: rotary caches some exporters save.
_IGNORABLE = re.compile(r"(^|\.)(rotary_emb\.)?(\w+_)?inv_freq$")


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config_json: dict
    path: Path                   # the model directory, or the .gguf file
    dtype: torch.dtype


# --- paths, config, dtype ---

def resolve_model_path(model: str | None) -> Path:
    if model is None:
        if not (BUNDLED_MODEL / "config.json").is_file():
            raise FileNotFoundError(
                f"the bundled model is missing: no config.json in {BUNDLED_MODEL}")
        return BUNDLED_MODEL
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return path


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def resolve_dtype(dtype: str, config_json: dict) -> torch.dtype:
    """"auto" = the config's torch_dtype/dtype when it is a float type we run, else float32."""
    if dtype == "auto":
        name = config_json.get("torch_dtype") or config_json.get("dtype")
        name = _DTYPE_ALIASES.get(name, name) if isinstance(name, str) else None
        return _DTYPES.get(name or "", torch.float32)
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


# --- building the module ---

@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters are created on the meta device (no memory, no init cost) while buffers are
    built for real: they hold computed values (rotary tables, expert maps) that no checkpoint
    carries. Uses torch's global registration hook, active only inside this block."""
    def to_meta(_module: nn.Module, _name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.device.type == "meta":
            return None
        return nn.Parameter(param.to("meta"), requires_grad=False)

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


class _MarkDefaultDtype(TorchFunctionMode):
    """Tensor factories called without `dtype=` (torch.empty, ones, randn, ...) return float64
    instead of the default float32, so that afterwards float64 parameters are exactly those the
    model built with the default dtype. Used only for a throwaway construction on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (isinstance(out, torch.Tensor) and out.dtype == torch.get_default_dtype()
                and kwargs.get("dtype") is None
                and not any(isinstance(a, torch.Tensor) for a in args)):
            return out.to(torch.float64)
        return out


def default_dtype_params(cls: type, config: object) -> set[str]:
    """Names of the parameters `cls(config)` creates in the default dtype. These follow the
    load dtype; a parameter the model creates with an explicit dtype (e.g. fp32 norms, mHC and
    attention sinks in DeepSeek-V4) keeps it."""
    with torch.device("meta"), _MarkDefaultDtype():
        probe = cls(config)
    return {n for n, p in probe.named_parameters(remove_duplicate=False)
            if p.dtype == torch.float64}


def keeps_fp32(cls: type, param_name: str) -> bool:
    """Whether the model class lists `param_name` in `keep_in_fp32`: dotted name fragments
    (like HF's `_keep_in_fp32_modules_strict`) matched against whole name components."""
    return any(re.search(rf"(^|\.){re.escape(p)}($|\.)", param_name)
               for p in cls.keep_in_fp32)


def build_model(cls: type, config: object, dtype: torch.dtype, device: torch.device,
                reshape: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Instantiate `cls(config)` with uninitialised parameters in their load dtype on `device`
    (device "meta" for a shape-only model). Parameters created with an explicit dtype keep it;
    those named in `cls.keep_in_fp32` are float32. Buffers are as the model built them; tied
    parameters stay tied. `reshape` sees the model while its parameters are still on meta
    (expert parallelism shrinks the routed experts to a rank's own there)."""
    follow = default_dtype_params(cls, config)
    with torch.device(device), _parameters_on_meta():
        model = cls(config)
        if reshape is not None:
            reshape(model)
    made: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                full = f"{mod_name}.{name}" if mod_name else name
                # (integer parameters, e.g. experts kept as checkpoint codes, keep their dtype)
                target = (torch.float32 if param.is_floating_point() and keeps_fp32(cls, full)
                          else dtype if full in follow and param.is_floating_point()
                          else param.dtype)
                # Modules marked HostResident (e.g. V4.1's Engram tables, far larger than a
                # device) keep their parameters in host memory; they gather rows themselves.
                where = ("cpu" if isinstance(module, HostResident)
                         and torch.device(device).type != "meta" else device)
                host = isinstance(module, HostResident) and where == "cpu"
                made[id(param)] = nn.Parameter(
                    module.allocate_host(param.shape, target) if host else
                    torch.empty(param.shape, dtype=target, device=where), requires_grad=False)
            module._parameters[name] = made[id(param)]
    return model.eval()


# --- filling it ---

def _required_groups(model: nn.Module) -> list[list[str]]:
    """Each parameter (all names of a tied one, any of which fills it) and persistent buffer."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    param_names = {n for names in aliases.values() for n in names}
    buffers = [[n] for n in model.state_dict(keep_vars=True) if n not in param_names]
    return list(aliases.values()) + buffers


TensorFilter = Callable[[Iterator[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]


def _checked(reader: CheckpointReader, model: nn.Module, yielded: list[str],
             tensor_filter: TensorFilter | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The reader's tensors (through `tensor_filter`, e.g. a rank's expert shard), minus
    ignorable ones, with shapes checked against the model."""
    state = model.state_dict(keep_vars=True)
    has_mtp = any(n.startswith(("mtp.", "model.mtp.")) for n in state)
    for name, tensor in (tensor_filter(iter(reader)) if tensor_filter else reader):
        if _IGNORABLE.search(name) or (not has_mtp and name.startswith(("mtp.", "model.mtp."))):
            continue
        target = state.get(name)
        if target is not None and tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{reader.directory}: tensor {reader.sources.get(name, name)} "
                             f"(as {name}) "
                             f"has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(target.shape)}")
        yielded.append(name)
        yield name, tensor


def _with_progress(tensors: Iterator[tuple[str, torch.Tensor]], model: nn.Module,
                   show: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A tqdm bar over the bytes of the model's parameters as the checkpoint fills them (a
    284B-parameter checkpoint takes minutes to read; silence looks like a hang). Tensors the
    model renames or keeps quantised count their own bytes; the bar ends full on success.
    Off for ranks other than the first and with TQDM_DISABLE=1."""
    state = model.state_dict(keep_vars=True)
    total = sum(t.numel() * t.element_size() for t in
                {id(t): t for t in state.values() if t.device.type != "meta"}.values())
    bar = tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True,
               unit_divisor=1024, disable=not show, dynamic_ncols=True)
    try:
        for name, tensor in tensors:
            target = state.get(name, tensor)
            bar.update(min(target.numel() * target.element_size(), total - bar.n))
            yield name, tensor
        bar.update(total - bar.n)
    finally:
        bar.close()


def packed_expert_names(model: nn.Module) -> frozenset[str]:
    """HF names of the routed-expert stacks the model holds in checkpoint format."""
    from wideserve.layers.experts import RoutedExperts
    return frozenset(f"{n}.{leaf}" for n, m in model.named_modules()
                     if isinstance(m, RoutedExperts) and m.weight_format is not None
                     for leaf in ("gate_up_proj", "down_proj"))


def packed_expert_format(model: nn.Module):  # -> layers.quant.ExpertFormat | None
    """The checkpoint format the model's routed experts are held in (None: dense)."""
    from wideserve.layers.experts import RoutedExperts
    return next((m.weight_format for m in model.modules()
                 if isinstance(m, RoutedExperts) and m.weight_format is not None), None)


def load_checkpoint(model: CausalLM, model_dir: Path, config_json: dict, dtype: torch.dtype,
                    tensor_filter: TensorFilter | None = None, progress: bool = True) -> None:
    """Stream the checkpoint into `model`. Unknown tensor names are the model's to reject
    (its `load_weights` raises for a name it cannot place); the error then names the file."""
    reader = CheckpointReader(model_dir, config_json, dtype,
                              keep_quantised=model.keeps_quantised,
                              packed_experts=packed_expert_names(model),
                              packed_format=packed_expert_format(model))
    yielded: list[str] = []
    try:
        with torch.no_grad():
            filled = set(model.load_weights(_with_progress(
                _checked(reader, model, yielded, tensor_filter), model, progress)))
    except (KeyError, ValueError) as exc:
        if not yielded or str(model_dir) in str(exc):
            raise
        raise ValueError(f"{model_dir}: while loading {reader.sources.get(yielded[-1])}: "
                         f"{exc}") from exc
    _drop_absent_mtp(model, filled, model_dir)
    check_filled(model, filled, f"{model_dir}")


def _drop_absent_mtp(model: CausalLM, filled: set[str], model_dir: Path) -> None:
    """A checkpoint with no mtp.* tensor at all for a model that built MTP blocks (any
    fine-tune saved by transformers) serves without them; a partial MTP block still fails."""
    if any(n.startswith("mtp.") for n in filled) or \
            not any(n.startswith("mtp.") for n in model.state_dict(keep_vars=True)):
        return
    reason = (f"the checkpoint {model_dir} has no MTP weights (no mtp.* tensors, as "
              f"transformers' save_pretrained writes it) although its config has "
              f"num_nextn_predict_layers >= 1")
    logger.warning("%s: serving without the MTP block; MTP speculation is unavailable", reason)
    model.drop_mtp(reason)


def check_filled(model: nn.Module, filled: Iterable[str], where: str) -> None:
    filled = set(filled)
    missing = [names[0] for names in _required_groups(model) if filled.isdisjoint(names)]
    if missing:
        raise ValueError(f"{where}: no weights for {len(missing)} model tensor(s): "
                         + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))


# --- entry point ---

def load_model(load: LoadConfig, expert_parallel: tuple[int, ...] | None = None, *,
               packed_experts: bool = True) -> LoadedModel:
    """`expert_parallel` = (ep_size, ep_rank[, num_redundant_experts]): build and load only
    this rank's routed experts (wideserve/worker/expert_shard.py). Routed experts stored FP8 /
    FP4 in the checkpoint stay in that format in memory (layers/experts.py
    `keep_checkpoint_format`); `packed_experts=False` dequantises them at load instead (the
    reference the packed path is tested against)."""
    path = resolve_model_path(load.model)
    device = torch.device(load.device)
    if load.load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load.load_format!r}")
    if load.load_format == "gguf" or (load.load_format == "auto" and path.suffix == ".gguf"):
        if expert_parallel is not None:
            raise ValueError("--enable-expert-parallel: GGUF checkpoints are not supported")
        return _load_gguf(path, load, device)
    if not path.is_dir():
        raise ValueError(f"{path}: load_format {load.load_format!r} needs a model directory "
                         "(with config.json); .gguf files load with 'auto' or 'gguf'")
    config_json = read_config(path)
    dtype = resolve_dtype(load.dtype, config_json)
    cls = resolve_model_class(config_json)
    placements: dict = {}
    fmt = None
    if packed_experts and load.load_format in ("auto", "safetensors"):
        fmt = checkpoint_expert_format(CheckpointReader(path, config_json, dtype))

    def reshape(meta_model: nn.Module) -> None:
        if fmt is not None:
            from wideserve.layers.experts import RoutedExperts
            for m in meta_model.modules():
                if isinstance(m, RoutedExperts):
                    m.keep_checkpoint_format(fmt)
        if expert_parallel is not None:
            from wideserve.worker.expert_shard import shard_experts
            placements.update(shard_experts(meta_model, *expert_parallel))
    config = cls.config_class.from_dict(config_json)
    if load.limit_mm_per_prompt.text_only and hasattr(config, "without_vision"):
        config = config.without_vision()      # --limit-mm-per-prompt image=0
    model = build_model(cls, config, dtype, device, reshape)
    if load.load_format == "dummy":
        check_filled(model, init_dummy_weights(model, load.seed), f"dummy weights for {path}")
        if placements:
            from wideserve.worker.expert_shard import fill_dummy_expert_shards
            fill_dummy_expert_shards(model, placements, load.seed)
    else:
        shard_filter = None
        if placements:
            from wideserve.worker.expert_shard import ExpertShardFilter
            shard_filter = ExpertShardFilter(placements)
        # One bar per node is enough: expert-parallel ranks other than 0 load silently.
        load_checkpoint(model, path, config_json, dtype, shard_filter,
                        progress=expert_parallel is None or expert_parallel[1] == 0)
    model.bind_tokenizer(path)      # models whose forward reads the vocabulary
    return LoadedModel(model=model, config_json=config_json, path=path, dtype=dtype)


def _load_gguf(path: Path, load: LoadConfig, device: torch.device) -> LoadedModel:
    if not path.is_file():
        raise ValueError(f"{path}: load_format 'gguf' needs a .gguf file")
    from wideserve.worker.gguf_loader import load_gguf_model

    dtype = resolve_dtype(load.dtype, {})
    model, config_json = load_gguf_model(path, dtype, device)
    return LoadedModel(model=model.eval(), config_json=config_json, path=path, dtype=dtype)
