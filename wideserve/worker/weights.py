"""Stream (HF name, tensor) pairs out of a safetensors checkpoint directory.

Handles a single `model.safetensors`, shards listed by `model.safetensors.index.json` (or bare
`*.safetensors` files), the original DeepSeek-V4 tensor names (renamed to the HF names the
models use, docs/deepseek_v4.md, "Checkpoint names"; see `deepseek_names.py`), per-expert tensors stacked
into `gate_up_proj` [E, 2I, d] / `down_proj` [E, d, I], and quantised weights with `.scale` /
`.weight_scale_inv` companions, dequantised to the load dtype (FP8 block-scaled, packed FP4), and
NVIDIA ModelOpt NVFP4 weights (`quant_method` "modelopt", `quant_algo` "NVFP4": `.weight_scale`
E4M3 per 16 values, `.weight_scale_2` fp32 global; `.input_scale` is not used: activations stay
unquantised). Routed experts the model holds in the checkpoint's format (`packed_format`,
layers/experts.py `keep_checkpoint_format`) are passed on as stored instead: codes as uint8,
their scales as stored (UE8M0 / E4M3 bytes, or fp32) under `<name>_scale` and NVFP4's global
scales under `<name>_global`, stacked per layer; per-expert names of any family (DeepSeek
`experts.{e}.w1/w2/w3`, HF `experts.{e}.gate_proj/up_proj/down_proj`) are stacked under
`<prefix>.gate_up_proj` / `.down_proj` (`checkpoint_expert_format` says which format a
checkpoint's experts are in).

Memory: tensors are read one at a time from memory-mapped files; stacking the experts of a
layer needs one buffer of that layer's stacked size at a time.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from wideserve.models.deepseek_v4.checkpoint_names import (EXPERT_RE, is_original_block_name,
                                                           rename_deepseek_v4)
from wideserve.layers import quant

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT_DTYPES = (None, "fp4", "fp8", "bf16", "bfloat16")
# Per-expert tensors of any family: DeepSeek's w1 (gate) / w3 (up) / w2 (down), HF's names.
PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
                           r"(?P<proj>w[123]|gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP = {"w1": ("w1", "w3"), "gate_proj": ("gate_proj", "up_proj")}
_DOWN = {"w1": ("w2",), "gate_proj": ("down_proj",)}


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """What the checkpoint's quantised tensors look like (from config.json)."""

    fp8_block: tuple[int, int] = (128, 128)
    fp4_group: int = 32
    expert_dtype: str | None = None
    nvfp4_group: int | None = None       # a ModelOpt NVFP4 checkpoint: its group size (16)

    @classmethod
    def from_config(cls, config_json: dict, where: str = "config.json") -> QuantFormat:
        qc = config_json.get("quantization_config") or {}
        method = qc.get("quant_method")
        if method == "modelopt":
            algo = qc.get("quant_algo")
            if algo != "NVFP4":
                raise ValueError(f"{where}: unsupported ModelOpt quant_algo {algo!r}; "
                                 "wideserve loads ModelOpt 'NVFP4' checkpoints")
            group = qc.get("group_size", 16)
            if not isinstance(group, int) or group <= 0 or group % 2:
                raise ValueError(f"{where}: quantization_config.group_size must be a positive "
                                 f"even int, got {group!r}")
            return cls(nvfp4_group=group, expert_dtype="nvfp4")
        if qc and method != "fp8":
            raise ValueError(f"{where}: unsupported quantization_config.quant_method {method!r}; "
                             "wideserve loads block-wise 'fp8' checkpoints (optional FP4 "
                             "experts) and ModelOpt 'NVFP4' ones")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{where}: unsupported quantization_config.fmt {qc['fmt']!r} "
                             "(need e4m3)")
        if qc.get("scale_fmt") not in (None, "ue8m0", "float32", "fp32"):
            raise ValueError(f"{where}: unsupported quantization_config.scale_fmt "
                             f"{qc['scale_fmt']!r}")
        block = qc.get("weight_block_size") or [128, 128]
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size must be two "
                             f"positive ints, got {block!r}")
        expert = config_json.get("expert_dtype", qc.get("expert_dtype"))
        if expert not in _EXPERT_DTYPES:
            raise ValueError(f"{where}: unsupported expert_dtype {expert!r}; "
                             f"known: {', '.join(str(e) for e in _EXPERT_DTYPES[1:])}")
        return cls(fp8_block=(block[0], block[1]), expert_dtype=expert)


def find_tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; clear errors for missing files."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' in the index")
        files = {name: directory / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"{index} lists {path.name}, which does not exist")
        return files
    single = directory / SINGLE_FILE
    shards = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no weights in {directory}: expected {SINGLE_FILE}, "
                                f"{INDEX_FILE} or *.safetensors files")
    files: dict[str, Path] = {}
    for path in shards:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} is in both {files[name].name} and "
                                     f"{path.name}")
                files[name] = path
    return files


def uses_original_deepseek_names(names: list[str]) -> bool:
    """Original DeepSeek block names (`layers.{i}.attn.wq_a.weight`, also under transformers'
    `model.` prefix) or top-level `embed.weight` / `head.weight`; `mtp.*` appears in both
    layouts, so it is judged by its inner names."""
    return any(n in ("embed.weight", "head.weight") or is_original_block_name(n) for n in names)


@dataclass(slots=True)
class CheckpointReader:
    """Iterate (hf_name, tensor); `sources[hf_name]` says which file/tensor it came from."""

    directory: Path
    config_json: dict
    dtype: torch.dtype                       # what quantised weights dequantise to
    files: dict[str, Path] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    quant_format: QuantFormat = field(default_factory=QuantFormat)
    rename: bool = False
    # Names (as yielded) whose quantised tensor is passed on as stored, followed by its scale
    # as `<name without .weight>.scale` (the model's `keeps_quantised`, e.g. V4.1's FP8
    # Engram tables kept FP8 in host memory); None: everything is dequantised.
    keep_quantised: Callable[[str], bool] | None = None
    # HF names of routed-expert stacks (`...experts.gate_up_proj` / `.down_proj`) to pass on in
    # the checkpoint's format (codes + `<name>_scale`), not dequantised.
    packed_experts: frozenset[str] = frozenset()
    # The format the model holds its routed experts in (None: dense): per-expert tensors are
    # then stacked as stored, scales converted to its `scale_dtype`.
    packed_format: quant.ExpertFormat | None = None
    _handles: dict[Path, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.files = find_tensor_files(self.directory)
        self.quant_format = QuantFormat.from_config(
            self.config_json, str(self.directory / "config.json"))
        model_type = self.config_json.get("model_type", "")
        self.rename = model_type == "deepseek_v4" and uses_original_deepseek_names(list(self.files))

    # --- raw access ---
    def _raw(self, name: str) -> torch.Tensor:
        path = self.files[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        return handle.get_tensor(name)

    def where(self, name: str) -> str:
        return f"{self.files[name].name}:{name}"

    def _scale_of(self, name: str) -> str | None:
        """The scale companion of `name`: `X.scale` / `X.weight_scale_inv` for `X.weight`, and
        `X_scale_inv` for a bare tensor X (HF's stacked FP8 experts)."""
        if name.endswith(".weight"):
            suffixes = (".scale", ".weight_scale_inv") + \
                ((".weight_scale",) if self.quant_format.nvfp4_group else ())
            candidates = [name[: -len(".weight")] + s for s in suffixes]
        else:
            candidates = [name + "_scale_inv"]
        return next((c for c in candidates if c in self.files), None)

    def _dense(self, name: str) -> torch.Tensor:
        """The tensor `name`, dequantised to `self.dtype` when it has a scale companion."""
        weight = self._raw(name)
        scale_name = self._scale_of(name)
        if scale_name is None:
            if weight.dtype == torch.float8_e4m3fn or weight.dtype == torch.float8_e5m2:
                raise ValueError(f"{self.where(name)}: FP8 tensor without a .scale companion")
            return weight
        scale = self._raw(scale_name)
        try:
            if scale_name.endswith(".weight_scale"):          # ModelOpt NVFP4
                return quant.dequantize_nvfp4(weight, scale, self._global(name),
                                              self.quant_format.nvfp4_group, self.dtype)
            if weight.dtype == torch.float8_e4m3fn:
                return quant.dequantize_fp8_block(weight, scale, self.quant_format.fp8_block,
                                                  self.dtype)
            if quant.is_fp4_storage(weight.dtype):
                return quant.dequantize_fp4(weight, scale, self.quant_format.fp4_group, self.dtype)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.where(name)} with {scale_name}: {exc}") from exc
        raise ValueError(f"{self.where(name)}: unsupported quantised weight dtype {weight.dtype} "
                         f"(scale {scale_name}); wideserve dequantises float8_e4m3fn and "
                         "packed FP4")

    def _global(self, name: str) -> torch.Tensor:
        """The NVFP4 global scale (`.weight_scale_2`, one fp32 value) of weight `name`."""
        gname = name.removesuffix(".weight") + ".weight_scale_2"
        if gname not in self.files:
            raise ValueError(f"{self.where(name)}: NVFP4 weight without {gname}")
        g = self._raw(gname).float()
        if g.numel() != 1:
            raise ValueError(f"{self.where(gname)}: a per-tensor global scale has one value, "
                             f"got shape {tuple(g.shape)}")
        return g.reshape(())

    def _hf_name(self, name: str) -> str:
        if not self.rename:
            return name
        try:
            return rename_deepseek_v4(name)
        except ValueError as exc:
            raise ValueError(f"{self.files[name]}: {exc}") from exc

    # --- iteration ---
    def _is_scale(self, name: str) -> bool:
        """Whether `name` is some weight's scale companion (the mHC `attn_hc.scale` parameter
        of an HF-named checkpoint is not: it has no `attn_hc.weight` beside it)."""
        companions = ((".scale", ".weight"), (".weight_scale_inv", ".weight"), ("_scale_inv", ""))
        if self.quant_format.nvfp4_group:
            companions += ((".weight_scale", ".weight"), (".weight_scale_2", ".weight"),
                           (".input_scale", ".weight"))
        for suffix, weight_suffix in companions:
            if name.endswith(suffix) and name[: -len(suffix)] + weight_suffix in self.files:
                return True
        return False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in file order; a layer's experts are stacked and emitted together where the
        first of them appears."""
        order = sorted((n for n in self.files if not self._is_scale(n)),
                       key=lambda n: (str(self.files[n]), _natural_key(n)))
        experts: dict[str, dict[int, dict[str, str]]] = {}
        expert_of: dict[str, str] = {}
        for name in order:
            m = (EXPERT_RE.match(name) if self.rename else
                 PER_EXPERT_RE.match(name) if self.packed_format is not None else None)
            if m is not None:
                group = experts.setdefault(m["prefix"], {})
                group.setdefault(int(m["expert"]), {})[m["proj"]] = name
                expert_of[name] = m["prefix"]
        done: set[str] = set()
        for name in order:
            prefix = expert_of.get(name)
            if prefix is None:
                hf = self._hf_name(name)
                self.sources[hf] = self.where(name)
                scale = self._scale_of(name)
                if hf in self.packed_experts:
                    yield from self._packed(hf, name)
                    continue
                if scale is not None and self.keep_quantised is not None and \
                        self.keep_quantised(hf):
                    yield hf, self._raw(name)
                    yield hf.removesuffix(".weight") + ".scale", self._raw(scale)
                    continue
                yield hf, self._dense(name)
            elif prefix not in done:
                done.add(prefix)
                yield from self._stacked_experts(prefix, experts[prefix])

    def _codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A quantised tensor as stored: (uint8 codes, scales in the packed format's storage,
        NVFP4 global scale [1] or None)."""
        fmt = self.packed_format or checkpoint_expert_format(self)
        scale_name = self._scale_of(name)
        weight = self._raw(name)
        fp8 = weight.dtype == torch.float8_e4m3fn
        if fmt is None or scale_name is None or fp8 != (fmt.kind == "fp8") or not (
                fp8 or quant.is_fp4_storage(weight.dtype)):
            raise ValueError(f"{self.where(name)}: expected "
                             f"{fmt.kind.upper() if fmt else 'FP8 e4m3 or packed FP4'} codes "
                             f"with a scale companion to keep experts in checkpoint format, got "
                             f"{weight.dtype}{'' if scale_name else ' without a scale'}")
        raw = self._raw(scale_name)
        try:
            if fmt.scale_dtype == "fp32":
                scale = quant.scale_to_float(raw)
            elif fmt.scale_dtype == "e4m3":
                if raw.dtype != torch.float8_e4m3fn:
                    raise ValueError(f"NVFP4 scales must be float8_e4m3fn, got {raw.dtype}")
                scale = raw.view(torch.uint8)
            else:
                scale = quant.ue8m0_bytes(raw)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.where(scale_name)}: {exc}") from exc
        glob = self._global(name).reshape(1) if fmt.has_global else None
        return weight.view(torch.uint8), scale, glob

    def _packed(self, hf: str, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """An HF-named expert stack kept in checkpoint format. A gate/up stack's FP8 scale grid
        is split into the gate's and the up projection's (ExpertFormat's layout); that needs
        I to be a multiple of the block rows, as it is when HF concatenated them."""
        codes, scale, glob = self._codes(name)
        if glob is not None:
            raise ValueError(f"{self.where(name)}: NVFP4 expert stacks load from per-expert "
                             "tensors (one global scale each)")
        self.sources[hf] = self.where(name)
        if hf.endswith("gate_up_proj") and self.quant_format.expert_dtype == "fp8":
            half, bm = codes.shape[1] // 2, self.quant_format.fp8_block[0]
            if half % bm:
                raise ValueError(f"{self.where(name)}: FP8 gate/up stack with I = {half} not a "
                                 f"multiple of the {bm}-row scale block: its scale grid mixes "
                                 f"gate and up rows")
        yield hf, codes
        yield hf + "_scale", scale

    def _stacked_experts(self, prefix: str, group: dict[int, dict[str, str]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        count = max(group) + 1
        first = "gate_proj" if any("gate_proj" in g for g in group.values()) else "w1"
        gate_up, down = _GATE_UP[first], _DOWN[first]
        for e in range(count):
            missing = [p for p in (*gate_up, *down) if p not in group.get(e, {})]
            if missing:
                raise ValueError(f"{self.directory}: expert {e} of {prefix} lacks "
                                 f"{', '.join(f'{prefix}.{e}.{p}.weight' for p in missing)}")
        # Without renaming (a family whose model places its own names, e.g. V4.1's official
        # `layers.{i}.ffn.experts`, Qwen3's `model.layers.{i}.mlp.experts`) the stacks keep the
        # checkpoint's prefix: the model maps it as any other name.
        hf_prefix = (rename_deepseek_v4(prefix + ".0.w1.weight").rsplit(".", 3)[0]
                     if self.rename else prefix)
        for hf_leaf, parts in (("gate_up_proj", gate_up), ("down_proj", down)):
            hf = f"{hf_prefix}.{hf_leaf}"
            if hf in self.packed_experts or (not self.rename and self.packed_format):
                yield from self._stacked_codes(hf, prefix, group, parts, count)
                continue
            buf: torch.Tensor | None = None
            for e in range(count):
                mats = [self._dense(group[e][p]) for p in parts]
                mat = mats[0] if len(mats) == 1 else torch.cat(mats, dim=0)
                if buf is None:
                    buf = torch.empty(count, *mat.shape, dtype=mat.dtype)
                if mat.shape != buf.shape[1:]:
                    raise ValueError(f"{self.where(group[e][parts[0]])}: expert shape "
                                     f"{tuple(mat.shape)} differs from expert 0's "
                                     f"{tuple(buf.shape[1:])}")
                buf[e] = mat
            self.sources[hf] = f"{prefix}.{{0..{count - 1}}}.{'+'.join(parts)}"
            yield hf, buf


    def _stacked_codes(self, hf: str, prefix: str, group: dict[int, dict[str, str]],
                       parts: tuple[str, ...], count: int) -> Iterator[tuple[str, torch.Tensor]]:
        """One layer's experts kept in checkpoint format: codes [E, rows, Kb] and scales
        [E, Sr, Sc], w1 then w3 for gate/up (each with its own scale grid)."""
        codes: torch.Tensor | None = None
        scales: torch.Tensor | None = None
        globs: torch.Tensor | None = None
        for e in range(count):
            triples = [self._codes(group[e][p]) for p in parts]
            c = torch.cat([t[0] for t in triples], dim=0)
            s = torch.cat([t[1] for t in triples], dim=0)
            if codes is None:
                codes = torch.empty(count, *c.shape, dtype=torch.uint8)
                scales = torch.empty(count, *s.shape, dtype=s.dtype)
                if triples[0][2] is not None:
                    globs = torch.empty(count, len(parts), dtype=torch.float32)
            if c.shape != codes.shape[1:] or s.shape != scales.shape[1:]:
                raise ValueError(f"{self.where(group[e][parts[0]])}: expert shape "
                                 f"{tuple(c.shape)} / scale {tuple(s.shape)} differs from "
                                 f"expert 0's")
            codes[e], scales[e] = c, s
            if globs is not None:
                globs[e] = torch.cat([t[2] for t in triples])
        source = f"{prefix}.{{0..{count - 1}}}.{'+'.join(parts)} (checkpoint format)"
        self.sources[hf] = self.sources[hf + "_scale"] = self.sources[hf + "_global"] = source
        yield hf, codes
        yield hf + "_scale", scales
        if globs is not None:
            yield hf + "_global", globs


# Model types whose routed experts the loader keeps in checkpoint format (every family with
# `RoutedExperts`: the reader stacks per-expert tensors of any of their layouts).
PACKED_EXPERT_MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "qwen3_moe")


def keeps_expert_format(config_json: dict) -> bool:
    """Whether the loader keeps this model family's FP8 / FP4 routed experts in checkpoint
    format (for `wideserve info --plan`, which sees the config only)."""
    return config_json.get("model_type") in PACKED_EXPERT_MODEL_TYPES


def checkpoint_expert_format(reader: CheckpointReader) -> quant.ExpertFormat | None:
    """The format the checkpoint's routed experts are stored in (FP8 e4m3 codes with UE8M0 or
    fp32 scales, packed FP4 codes with UE8M0 scales (MXFP4) or E4M3 scales and a global scale
    (ModelOpt NVFP4)), or None (dense experts). Per-expert tensors of any family and HF fused
    stacks qualify."""
    qf = reader.quant_format
    for name in sorted(reader.files):
        if not (EXPERT_RE.match(name) or PER_EXPERT_RE.match(name)
                or name.endswith((".experts.gate_up_proj", ".experts.down_proj"))):
            continue
        scale_name = reader._scale_of(name)
        if scale_name is None:
            return None
        dtype, sdtype = reader._raw(name).dtype, reader._raw(scale_name).dtype
        byte_scale = sdtype in (torch.float8_e8m0fnu, torch.uint8)
        if dtype == torch.float8_e4m3fn:
            return quant.expert_format("fp8", qf.fp8_block,
                                       scale_dtype="ue8m0" if byte_scale else "fp32")
        if quant.is_fp4_storage(dtype) and scale_name.endswith(".weight_scale"):
            return quant.expert_format("nvfp4", nvfp4_group=qf.nvfp4_group)
        if quant.is_fp4_storage(dtype):
            return quant.expert_format("fp4", fp4_group=qf.fp4_group,
                                       scale_dtype="ue8m0" if byte_scale else "fp32")
        return None
    return None


def _natural_key(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
