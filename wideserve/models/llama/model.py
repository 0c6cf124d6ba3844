"""Dense Llama-family decoders (Llama, Qwen2, Qwen3) over the paged varlen batch.

One implementation; the families differ only in config switches:
- Llama: `attention_bias` on q/k/v/o, `mlp_bias` on the MLP.
- Qwen2: bias on q/k/v (never on o), optional sliding window on layers >= max_window_layers.
- Qwen3: per-head RMSNorm of q and k before RoPE, `attention_bias` on q/k/v/o.
Parameter names are those of the transformers state dict, so HF checkpoints load by name.
The building blocks (attention, dense MLP, decoder stack, causal-LM base) are shared with
`qwen3_moe.py`, which swaps the MLP of its sparse layers for a routed MoE block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.types.forward_batch import ForwardBatch
from wideserve.layers.attention.paged_attention_batched import (PagedAttentionConfig,
                                                                PagedAttentionPlans)
from wideserve.layers.attention.paged_decode_static import is_decode_batch, paged_decode_static
from wideserve.layers.attention.registry import (
    get_paged_attention_backend,
    resolve_paged_attention_backend,
    static_decode,
)
from wideserve.layers.gemm_shapes import AttentionShape, DeclaresGemms, GemmShape
from wideserve.layers.linear import GemmCall, WeightPack
from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope_rotate_half import (RopeScaling, RotaryEmbedding, apply_rotary,
                                               fused_norm_rope_applies, norm_rope_qkv_,
                                               parse_rope_config)
from wideserve.models import lean_decode
from wideserve.models.interface import CausalLM

if TYPE_CHECKING:
    from wideserve.config import KernelConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16,
              "fp32": torch.float32, "float32": torch.float32}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()    # layer indices that attend through the window

    @classmethod
    def from_dict(cls, config_json: dict) -> LlamaConfig:
        bias = bool(config_json.get("attention_bias", False))
        return cls(**_common_fields(config_json, default_head_dim=None),
                   qkv_bias=bias, o_bias=bias, mlp_bias=bool(config_json.get("mlp_bias", False)))

    def window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if layer_idx in self.sliding_layers else None


class Qwen2Config(LlamaConfig):
    __slots__ = ()

    @classmethod
    def from_dict(cls, config_json: dict) -> Qwen2Config:
        return cls(**_common_fields(config_json, default_head_dim=None),
                   **_qwen_sliding(config_json, all_layers=False), qkv_bias=True)


class Qwen3Config(LlamaConfig):
    __slots__ = ()

    @classmethod
    def from_dict(cls, config_json: dict) -> Qwen3Config:
        bias = bool(config_json.get("attention_bias", False))
        return cls(**_common_fields(config_json, default_head_dim=128),
                   **_qwen_sliding(config_json, all_layers=False),
                   qkv_bias=bias, o_bias=bias, qk_norm=True)


def _common_fields(d: dict, default_head_dim: int | None) -> dict:
    """Fields every family shares, with transformers' defaults where a key is absent."""
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks required field(s) {', '.join(missing)}")
    heads = int(d["num_attention_heads"])
    act = d.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config: hidden_act {act!r} is not supported "
                         f"(supported: {', '.join(_ACTIVATIONS)})")
    theta, scaling = parse_rope_config(d)
    head_dim = d.get("head_dim") or default_head_dim or int(d["hidden_size"]) // heads
    return dict(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), hidden_act=act)


def _qwen_sliding(d: dict, all_layers: bool) -> dict:
    """Qwen2/Qwen3 (per `layer_types` / `max_window_layers`) and Qwen3-MoE (every layer)
    use the window only when `use_sliding_window` is true, as transformers does."""
    if not d.get("use_sliding_window") or d.get("sliding_window") is None:
        return dict(sliding_window=None, sliding_layers=())
    window = int(d["sliding_window"])
    n = int(d["num_hidden_layers"])
    if all_layers:
        return dict(sliding_window=window, sliding_layers=tuple(range(n)))
    types = d.get("layer_types") or [
        "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
        for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config: layer_types has {len(types)} entries for {n} layers")
    return dict(sliding_window=window,
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))


class Attention(nn.Module, DeclaresGemms):
    """GQA self-attention with RoPE over the layer's paged K||V cache."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, backend: str) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = hd ** -0.5
        self.window = cfg.window_of(layer_idx)
        self.cache_name = kv_cache_name(layer_idx)
        self.backend = backend                  # a layers/attention/registry.py paged backend name
        # the fused C++ q/k norm + RoPE op on the CPU (False: torch; from KernelConfig.cpu_rope)
        self.cpu_kernel = True
        # q/k/v as one GEMM and o packed (layers/linear.py); the parameters stay HF's.
        self._qkv, self._o = WeightPack(), WeightPack()
        self._split = (self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, plans: PagedAttentionPlans) -> torch.Tensor:
        t = x.shape[0]
        q_p, k_p, v_p = self.q_proj, self.k_proj, self.v_proj
        qkv = self._qkv.linear(x, (q_p.weight, k_p.weight, v_p.weight),
                               (q_p.bias, k_p.bias, v_p.bias))
        # On the CPU one C++ pass does the q/k norms and RoPE in place (layers/rope_rotate_half.py);
        # elsewhere the torch ops below, which are its reference.
        fused = fused_norm_rope_applies(qkv, self.cpu_kernel)
        if fused:
            qn, kn = self.q_norm, self.k_norm
            norm_rope_qkv_(qkv, cos, sin, None if qn is None else qn.weight,
                           None if kn is None else kn.weight, self.num_heads,
                           self.num_kv_heads, 0.0 if qn is None else qn.eps)
        q, k, v = torch.split(qkv, self._split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)                     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)                  # [T, Hkv, D]
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if static_decode(self.backend, q.device) and _decode_batch(batch):
            # Shapes fixed by the batch size, device metadata only: traced and captured.
            o = paged_decode_static(q, k, v, batch, self.cache_name, self.scale, self.window)
        else:
            o = _attend(get_paged_attention_backend(self.backend), q, k, v, batch,
                        self.cache_name, self.scale, self.window, plans)
        return self._o.linear(o.reshape(t, -1), (self.o_proj.weight,),
                              (self.o_proj.bias,))                         # [T, d]

    def gemm_calls(self, dtype: torch.dtype, rows: int) -> tuple[GemmCall | None,
                                                                 GemmCall | None]:
        """The fused q/k/v and the o GEMM that `forward` runs for `rows` rows in `dtype`
        (WeightPack's own choice; None where it would not run a C++ op): the lean decoder
        forward's plan (models/lean_decode.py)."""
        q_p, k_p, v_p, o_p = self.q_proj, self.k_proj, self.v_proj, self.o_proj
        return (self._qkv.gemm_call((q_p.weight, k_p.weight, v_p.weight),
                                    (q_p.bias, k_p.bias, v_p.bias), dtype, rows),
                self._o.gemm_call((o_p.weight,), (o_p.bias,), dtype, rows))

    def gemm_shapes(self) -> list[GemmShape | AttentionShape]:
        """q/k/v as one GEMM, o, and the paged attention itself."""
        return [GemmShape("qkv", sum(self._split), self.q_proj.in_features),
                GemmShape("linear", self.o_proj.out_features, self.o_proj.in_features),
                AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim)]

    @property
    def qkv_split(self) -> tuple[int, int, int]:
        """Widths of q, k and v in the fused projection's output."""
        return self._split


def _decode_batch(batch: ForwardBatch) -> bool:
    """is_decode_batch, decided by the shapes while compiling: every request the runner
    schedules has at least one token, so R requests of T = R tokens are one token each, and
    the host offsets need not be read (a traced numpy read is a data-dependent branch)."""
    if torch.compiler.is_compiling():
        return batch.kv_write_start is None and \
            batch.input_ids.shape[0] == batch.seq_lens.shape[0]
    return is_decode_batch(batch)


@torch.compiler.disable
def _attend(attend: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """The paged attention op, eager: its plan is host (numpy) work over the step's batch, and
    its shapes follow the contexts; a compiled forward is split around it. (Decode batches on
    the static path are not: `Attention.forward` calls that op directly.)"""
    return attend(*args)


class DenseMLP(nn.Module, DeclaresGemms):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]
        self._gate_up, self._down = WeightPack(), WeightPack()   # layers/linear.py

    def gemm_shapes(self) -> list[GemmShape | AttentionShape]:
        """gate/up as one GEMM, then down."""
        g, d = self.gate_proj, self.down_proj
        return [GemmShape("qkv", 2 * g.out_features, g.in_features),
                GemmShape("linear", d.out_features, d.in_features)]

    def lean_mlp(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """On the lean path a dense MLP is called as the module, hooks and all
        (models/lean_decode.py)."""
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj, self.up_proj
        gate, up = self._gate_up.linear(x, (g.weight, u.weight), (g.bias, u.bias)).chunk(2, -1)
        return self._down.linear(self.act(gate) * up, (self.down_proj.weight,),
                                 (self.down_proj.bias,))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, mlp: nn.Module, backend: str) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, plans: PagedAttentionPlans) -> torch.Tensor:
        h, delta = self.step(h, None, cos, sin, batch, plans)
        return h + delta

    def step(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, batch: ForwardBatch, plans: PagedAttentionPlans
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream h + delta (delta None: h alone) -> (h', delta'),
        the MLP's output left unadded, so each residual add is fused with the norm after it
        (layers/norm.py add_rms_norm: one C++ pass on the CPU)."""
        if delta is None:
            x = self.input_layernorm.fast(h)
        else:
            h, x = self.input_layernorm.add_and_norm(h, delta)
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.self_attn(x, cos, sin, batch, plans))
        return h, self.mlp(x)


class DecoderModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, make_mlp: Callable[[int], nn.Module],
                 backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_mlp(i), backend) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

        self._run_layers = self.run_layers     # compile_layers(): its compiled form
        # The lean CPU forward where it applies (models/lean_decode.py); False: always the
        # module path (A/B runs, tests).
        self.lean_decode = True
        # The paged attention op's CPU paths (from the engine's KernelConfig).
        self.attention_config = PagedAttentionConfig()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)                 # [T, d]
        seq_lens = batch.seq_lens_cpu                          # bounds every position
        # The bound picks table rows on the CPU; compiled, the rows are computed and the host
        # copy is not read (a traced numpy read is a data-dependent value).
        bound = None if torch.compiler.is_compiling() else \
            int(seq_lens.max()) if seq_lens.size else 0
        cos, sin = self.rotary.cos_sin(batch.positions, bound)   # [T, D] fp32, shared
        plans = PagedAttentionPlans(batch, config=self.attention_config)   # shared by layers
        return self._run_layers(h, cos, sin, batch, plans)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: ForwardBatch, plans: PagedAttentionPlans) -> torch.Tensor:
        # On the CPU the same C++ ops as a flat loop, where every layer would run them
        # (models/lean_decode.py: bitwise this path's result, without its per-call Python).
        lean = lean_decode.plan_layers(self, h, batch, plans)
        if lean is not None:
            return lean_decode.run_layers(lean, self.norm, h, cos, sin)
        delta = None
        for layer in self.layers:
            h, delta = layer.step(h, delta, cos, sin, batch, plans)
        return self.norm.fast(h) if delta is None else self.norm.add_and_norm(h, delta)[1]

    def compile_layers(self) -> None:
        """torch.compile the layer stack, the token count dynamic (one graph set serves every
        batch size; no padding). The attention ops stay eager (`_attend`), so the graphs are
        the pieces between them: norms, projections, RoPE, residuals, MLP / MoE."""
        self._run_layers = torch.compile(self.run_layers, dynamic=True)


def kv_cache_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn.kv"


# Names some checkpoints carry that are derived state here, not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(CausalLM):
    """The causal-LM surface (wideserve.models.interface.CausalLM) shared by the families."""

    functional_gemms = False     # every GEMM is in a WeightPack or the fused experts

    config_class: type[LlamaConfig] = LlamaConfig

    def __init__(self, config: LlamaConfig, attention_backend: str | None = None) -> None:
        """attention_backend: a layers/attention/registry.py paged backend name; None = $WIDESERVE_ATTENTION_BACKEND,
        else the default ("batched")."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self._make_mlp,
                                  resolve_paged_attention_backend(attention_backend))
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._head = WeightPack()

    def apply_kernel_config(self, kernels: KernelConfig) -> None:
        super().apply_kernel_config(kernels)
        for m in self.modules():
            if isinstance(m, Attention):
                m.cpu_kernel = kernels.cpu_rope
        # by keyword: a positional batch_invariant once landed on sdpa_context (issue 27)
        self.model.attention_config = PagedAttentionConfig(
            cpu_kernel=kernels.cpu_attention, sdpa_prefill=kernels.sdpa_prefill,
            fused_kv_write=kernels.fused_kv_write, batch_invariant=kernels.batch_invariant)

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DenseMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias)

    @property
    def attention_backend(self) -> str:
        return next((m.backend for m in self.modules() if isinstance(m, Attention)), "")

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention layer to backend `name` (layers/attention/registry.py)."""
        name = resolve_paged_attention_backend(name)
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = name

    def decode_capturable(self, device: torch.device) -> bool:
        """Whether a CUDA graph can record the decode forward on `device` (docs/cuda_graphs.md):
        on CUDA, when every attention layer runs decode batches through the static-shape
        path (registry.static_decode; the default backend does there). The rest of the
        decoder is plain torch on CUDA (the C++ ops are CPU-only): fixed shapes, no sync."""
        return device.type == "cuda" and all(
            static_decode(m.backend, device) for m in self.modules() if isinstance(m, Attention))

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        if kv_cache_dtype == "auto":
            dtype = self.model.embed_tokens.weight.dtype
        elif kv_cache_dtype in _KV_DTYPES:
            dtype = _KV_DTYPES[kv_cache_dtype]
        else:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported by {type(self).__name__} "
                f"(quantised KV records exist only for DeepSeek-V4); use 'auto' or 'bf16'")
        c = self.config
        width = 2 * c.num_key_value_heads * c.head_dim
        specs = {}
        for i in range(c.num_hidden_layers):
            window = c.window_of(i)
            specs[kv_cache_name(i)] = (
                KVCacheSpec(CacheKind.FULL, "kv", width, dtype) if window is None else
                KVCacheSpec(CacheKind.SLIDING_WINDOW, "kv", width, dtype, window=window))
        return specs

    def param_counts(self) -> tuple[int, int]:
        total = sum(p.numel() for p in self.parameters())
        return total, total

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compile_forward(self) -> bool:
        """The compiled forward (LoadConfig.enforce_eager=False); compiling happens lazily, at
        the first steps of each shape class (prefill, decode)."""
        self.model.compile_layers()
        return True

    def tied_head_shape(self) -> tuple[int, int] | None:
        if self.lm_head is not None:
            return None
        vocab, hidden = self.model.embed_tokens.weight.shape
        return vocab, hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # fp32 logits of the bf16-rounded values, in one pass on the CPU kernel path
        return self._head.linear(hidden, (weight,), widen=True)     # [N, V]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue    # tied: the embedding is the head
            filled = self._load_special(name, tensor, params)
            if filled is None:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(self).__name__}")
                _copy_checked(params[name], tensor, name)
                filled = name
            if filled:
                loaded.add(filled)
        return loaded

    def _load_special(self, name: str, tensor: torch.Tensor,
                      params: dict[str, nn.Parameter]) -> str | None:
        """Hook for names that are not 1:1 with a parameter: return the parameter name filled
        (or "" when filled only partly so far), None to fall back to the 1:1 copy."""
        return None


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


class LlamaForCausalLM(DecoderForCausalLM):
    config_class = LlamaConfig


class Qwen2ForCausalLM(DecoderForCausalLM):
    config_class = Qwen2Config


class Qwen3ForCausalLM(DecoderForCausalLM):
    config_class = Qwen3Config
