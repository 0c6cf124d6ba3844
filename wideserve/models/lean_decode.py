"""The Llama-family decoder stack on the CPU as a flat loop of C++ ops (docs/cpu_kernels.md,
"Lean decoder forward").

The module path (`DecoderLayer.step` -> `Attention.forward` -> `WeightPack.linear` -> ...)
decides at every call which op runs: grad mode, compiling, device and dtype checks, weight
fingerprints, backend lookups, `torch.compiler.disable` wrappers, ~136 `Module.__getattr__`
and ~17 module calls per forward of the 11M Qwen3-MoE, about a quarter of a decode forward's
CPU time (BENCHMARKS.md, "Decode forward in the engine"). A second torch thread shares none of
it. Here those decisions are taken once per forward, for every layer, with the module path's
own checks (`WeightPack.gemm_call`, `RoutedExperts.fused_op`, the norm, RoPE and
attention `cpu_kernel_applies`), and the same ops then run with the same arguments in a flat
loop, so the outputs and the KV cache are bitwise the module path's (tests/models/
test_lean_decode.py). Where any decision would not come out as the C++ op (autograd, compile,
CUDA, fp32 weights, the reference attention backend, a prefix replay's partial KV write, an
expert-parallel dispatcher or replicas, a hook on a module it would bypass, the model's
`lean_decode` field off), the
module path runs the whole forward. Dense MLP layers are called as modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from wideserve.kernels import weight_stream
from wideserve.types.forward_batch import ForwardBatch
from wideserve.layers import rope_rotate_half as rotary
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers.attention.paged_attention_batched import PagedAttentionPlans
from wideserve.layers.linear import GemmCall
from wideserve.layers.norm import cpu_kernel_applies as norm_applies
from wideserve.layers.norm import RMSNorm

# MLP of a layer on the lean path: the normalised rows [T, d] -> the MLP's output [T, d].
LeanMLP = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LeanLayer:
    """One decoder layer's op arguments for one forward."""

    in_norm: torch.Tensor            # fp32 weights of the two norms
    in_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: GemmCall                    # the GEMM WeightPack.linear runs for this many rows
    o: GemmCall
    q_norm: torch.Tensor | None      # per-head norm weights as Attention passes them
    k_norm: torch.Tensor | None
    qk_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    split: tuple[int, int, int]
    attention: tuple                 # paged_attention_write's arguments after q, k, v
    mlp: LeanMLP


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as mod
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks
                or mod._global_backward_hooks or mod._global_backward_pre_hooks)


def plan_layers(model: Any, h: torch.Tensor, batch: ForwardBatch,
                plans: PagedAttentionPlans) -> list[LeanLayer] | None:
    """The lean arguments of every layer of `model` (a llama.DecoderModel) for this forward,
    or None where the module path must run."""
    if torch.compiler.is_compiling():
        return None          # a compiled graph traces the module path
    if not (model.lean_decode and h.is_cpu and h.dim() == 2 and not torch.is_grad_enabled()
            and plans.config.cpu_kernel and plans.config.fused_kv_write
            and norm_applies(h, model.norm.weight, model.norm.cpu_kernel)) or _global_hooks():
        return None          # norm_applies also covers compiling and the extension build
    if h.dtype not in rotary.KERNEL_DTYPES or h.dtype not in pab.KERNEL_DTYPES:
        return None
    # The small-batch decode path (worker/small_batch.py) reuses the batch's tensors step to
    # step: the plan, made of them and the weights, is kept while no module gained a hook.
    cache = batch.plan_cache
    if cache is not None:
        kept = cache.get("lean")
        if kept is not None and kept[0] is model and kept[1] is h.dtype and not any(kept[3]):
            return kept[2]
    out = []
    for layer in model.layers:
        lean = _plan_layer(layer, h.dtype, h.shape[0], batch, plans)
        if lean is None:
            return None
        out.append(lean)
    if cache is not None:
        cache["lean"] = (model, h.dtype, out,
                         tuple(d for layer in model.layers for d in _hook_dicts(layer)))
    return out


def _hook_dicts(layer: Any) -> list[dict]:
    """The hook dicts of the modules `_plan_layer` checks (registering a hook adds to the
    module's dict, so a kept plan checks them all with one `any`)."""
    attn, mlp = layer.self_attn, layer.mlp
    mods = (layer, attn, layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm,
            attn.k_norm, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp,
            getattr(mlp, "gate", None), getattr(mlp, "experts", None))
    return [d for m in mods if isinstance(m, nn.Module)
            for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                      m._backward_pre_hooks)]


def _plan_layer(layer: Any, dtype: torch.dtype, rows: int, batch: ForwardBatch,
                plans: PagedAttentionPlans) -> LeanLayer | None:
    attn = layer.self_attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(_hooked(m) for m in (layer, attn, *norms)) or attn.backend != "batched":
        return None
    if not (attn.cpu_kernel and all(n.cpu_kernel for n in norms)):
        return None          # a C++ op switched off (KernelConfig): the module path
    qn, kn = attn.q_norm, attn.k_norm
    if any(m is not None and _hooked(m) for m in (qn, kn)):
        return None
    if any(_hooked(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
        return None
    # the kernel the table picked for this many rows (WeightPack.linear's own choice)
    qkv, o = attn.gemm_calls(dtype, rows)
    attention = _attention_args(attn, batch, plans, dtype)
    # Every MLP of a lean-capable layer declares its lean form (llama.DenseMLP: the module
    # itself; qwen3_moe.SparseMoeBlock: the router and fused-experts ops).
    mlp = layer.mlp.lean_mlp(batch.input_ids.device, dtype)
    if qkv is None or o is None or attention is None or mlp is None:
        return None
    return LeanLayer(norms[0].fp32_weight(), norms[0].eps, norms[1].fp32_weight(),
                     norms[1].eps, qkv, o, None if qn is None else qn.weight,
                     None if kn is None else kn.weight, 0.0 if qn is None else qn.eps,
                     attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qkv_split,
                     attention, mlp)


def _attention_args(attn: Any, batch: ForwardBatch, plans: PagedAttentionPlans,
                    dtype: torch.dtype) -> tuple | None:
    """paged_attention_write's arguments after q, k, v, where paged_attention_batched would
    call it (every token's entry written by the op; the checks that raise there send the
    forward to the module path, which raises them)."""
    cache, view = batch.cache(attn.cache_name)
    if view.compress_ratio != 1 or view.block_size != cache.shape[1] \
            or 2 * attn.num_kv_heads * attn.head_dim != cache.shape[-1] \
            or cache.dtype not in pab.KERNEL_DTYPES or not cache.is_cpu:
        return None
    if plans.write(attn.cache_name, attn.window).rows is not None:
        return None          # a bounded replay writes part of the rows: the torch write
    if plans.sdpa_prefill(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype,
                          attn.window) is not None:
        return None          # whole prefills on SDPA (kernel choice): the module path
    if plans.context_split(attn.cache_name, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           dtype, attn.window) is not None:
        return None          # chunked / mixed prefills partly on SDPA: the module path
    return (cache, view.slot_mapping, view.block_table, view.req_rows, batch.query_start_loc,
            batch.seq_lens, attn.scale, 0 if attn.window is None else attn.window, False)


def hooked(*modules: nn.Module) -> bool:
    """Whether any of `modules` has a hook the lean path would bypass."""
    return any(_hooked(m) for m in modules)


def run_layers(layers: list[LeanLayer], final_norm: RMSNorm, h: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DecoderModel.run_layers over the planned layers: the same ops, in the same order."""
    ops = torch.ops.wideserve
    cos, sin = cos.contiguous(), sin.contiguous()
    rot = cos.shape[-1]
    delta = None
    # Weight streaming (kernels/weight_stream.py): each MoE call's helper goes on to the next
    # layer's attention weights (the last layer's: the first layer's, for the next step).
    tails = [[c.weight for c in (n.qkv, n.o) if c.kernel != "onednn"]   # oneDNN's is opaque
             for n in layers[1:] + layers[:1]] if layers and weight_stream.active() else None
    for i, L in enumerate(layers):
        if delta is None:
            x = ops.rms_norm(h, L.in_norm, L.in_eps)
        else:
            h, x = ops.add_rms_norm(h, delta, L.in_norm, L.in_eps)
        t = x.shape[0]
        qkv = L.qkv.fn(x, L.qkv.weight, L.qkv.bias, L.qkv.out, False)            # [T, N]
        ops.qk_norm_rope_(qkv, cos, sin, L.q_norm, L.k_norm, L.heads, L.kv_heads, rot,
                          L.qk_eps, False)
        q, k, v = torch.split(qkv, L.split, dim=-1)
        o = ops.paged_attention_write(q.view(t, L.heads, L.head_dim),
                                      k.view(t, L.kv_heads, L.head_dim),
                                      v.view(t, L.kv_heads, L.head_dim), *L.attention)
        o = L.o.fn(o.reshape(t, -1), L.o.weight, L.o.bias, L.o.out, False)
        h, x = ops.add_rms_norm(h, o, L.post_norm, L.post_eps)
        if tails is not None:
            weight_stream.queue(tails[i])
        delta = L.mlp(x)
    if delta is None:
        return ops.rms_norm(h, final_norm.fp32_weight(), final_norm.eps)
    return ops.add_rms_norm(h, delta, final_norm.fp32_weight(), final_norm.eps)[1]
