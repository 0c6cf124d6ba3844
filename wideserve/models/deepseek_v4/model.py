"""DeepSeek-V4 causal LM over wideserve's paged varlen batch (docs/deepseek_v4.md).

Parameter names are the Hugging Face state_dict names (`model.layers.{i}.self_attn.q_a_proj.
weight`, `model.hc_head.hc_fn`, `lm_head.weight`, ...), so an HF state dict loads directly.
The MTP block lives under `mtp.{i}.` (reference §3.10; HF does not build it).

For speculative decoding: `forward` leaves the pre-hc_head residual streams of its tokens in
`last_streams` [T, n, d]; `mtp_forward(batch, streams, next_token_ids)` runs the MTP block for
those tokens (its caches: `mtp_kv_cache_specs()`), then `compute_logits`.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.types.forward_batch import ForwardBatch
from wideserve.layers.attention.paged_decode_static import is_decode_batch
from wideserve.layers.attention.registry import resolve_attention_backend, static_decode
from wideserve.layers.attention.v4_static import V4DecodeStep
from wideserve.layers.experts import RoutedExperts
from wideserve.models.deepseek_v4.attention import DeepseekV4Attention
from wideserve.layers.attention.v4_step import V4Step
from wideserve.layers.kv_quant import RecordCodec, codec_for
from wideserve.layers.mhc import HyperConnection, HyperHead
from wideserve.layers.moe import DeepseekV4MoE
from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope_interleaved import RotaryTable
from wideserve.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from wideserve.models.interface import CausalLM

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


class DeepseekV4DecoderLayer(nn.Module):
    """mHC -> attention -> mHC -> MoE. HF names: input_layernorm, post_attention_layernorm,
    attn_hc, ffn_hc, self_attn, mlp."""

    def __init__(self, config: DeepseekV4Config, layer_type: str, mlp_type: str,
                 cache_prefix: str, main_rope: RotaryTable, compress_rope: RotaryTable,
                 attention_backend: str | None = None) -> None:
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.self_attn = DeepseekV4Attention(c, layer_type, cache_prefix, main_rope,
                                             compress_rope, attention_backend)
        self.mlp = DeepseekV4MoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts,
                                 c.num_experts_per_tok, c.scoring_func,
                                 c.routed_scaling_factor, c.swiglu_limit,
                                 mlp_type == "hash_moe", c.vocab_size, c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps).float()
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps).float()
        self.attn_hc = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters,
                                       c.hc_eps, c.rms_norm_eps)
        self.ffn_hc = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters,
                                      c.hc_eps, c.rms_norm_eps)

    def forward(self, streams: torch.Tensor, step: V4Step | V4DecodeStep,
                input_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, n, d] -> [T, n, d]."""
        post, comb, x = self.attn_hc(streams)
        streams = self.attn_hc.expand(streams, post, comb,
                                      self.self_attn(self.input_layernorm(x), step))
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(self.post_attention_layernorm(x), input_ids)
        return self.ffn_hc.expand(streams, post, comb, y)


class DeepseekV4MTP(DeepseekV4DecoderLayer):
    """One MTP block (reference §3.10): a sliding-window, top-k-routed decoder layer plus
    e_proj/h_proj/enorm/hnorm on the way in and its own hc_head and norm on the way out.

    For the token at position p: x = e_proj(enorm(embed(token p+1))) (broadcast over streams)
    + h_proj(hnorm(X_main[p])) per stream; block at rope position p; hc_head; norm; the shared
    lm_head then predicts the token at p+2.
    """

    def __init__(self, config: DeepseekV4Config, index: int, main_rope: RotaryTable,
                 compress_rope: RotaryTable, attention_backend: str | None = None) -> None:
        super().__init__(config, SLIDING, "moe", f"mtp.{index}.self_attn.", main_rope,
                         compress_rope, attention_backend)
        c = config
        d = c.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, c.rms_norm_eps).float()
        self.hnorm = RMSNorm(d, c.rms_norm_eps).float()
        self.norm = RMSNorm(d, c.rms_norm_eps).float()
        self.hc_head = HyperHead(c.hc_mult, d, c.hc_eps, c.rms_norm_eps)

    def run(self, embeds: torch.Tensor, streams: torch.Tensor, step: V4Step,
            next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, d] of the next tokens, streams [T, n, d] -> (hidden [T, d], streams)."""
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds))[:, None, :]
        out = super().forward(x, step, next_token_ids)
        return self.norm(self.hc_head(out)), out


class DeepseekV4Model(nn.Module):
    """HF names under `model.`: embed_tokens, layers, norm, hc_head."""

    def __init__(self, config: DeepseekV4Config, main_rope: RotaryTable,
                 compress_rope: RotaryTable, attention_backend: str | None = None) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(c, c.layer_types[i], c.mlp_layer_types[i],
                                   f"model.layers.{i}.self_attn.", main_rope, compress_rope,
                                   attention_backend)
            for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps).float()
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)


class DeepseekV4ForCausalLM(CausalLM):
    config_class = DeepseekV4Config
    supports_mtp = True
    # Parameters that stay fp32 whatever the load dtype (HF's _keep_in_fp32_modules_strict,
    # plus the MTP norms); name components, read by the loader's build_model.
    keep_in_fp32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias",
                    "e_score_correction_bias", "q_a_norm", "kv_norm", "input_layernorm",
                    "post_attention_layernorm", "norm", "enorm", "hnorm")

    def __init__(self, config: DeepseekV4Config, attention_backend: str | None = None) -> None:
        """attention_backend: a layers/attention/registry.py V4 backend name; None = $WIDESERVE_ATTENTION_BACKEND,
        else the default ("batched")."""
        super().__init__()
        self.config = config
        backend = resolve_attention_backend(attention_backend)
        r = config.qk_rope_head_dim
        self.main_rope = RotaryTable(config.rope_parameters["main"], r)
        self.compress_rope = RotaryTable(config.rope_parameters["compress"], r)
        self.model = DeepseekV4Model(config, self.main_rope, self.compress_rope, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(
            DeepseekV4MTP(config, i, self.main_rope, self.compress_rope, backend)
            for i in range(config.num_nextn_predict_layers))
        # Why the MTP block is unavailable although the config asks for one (drop_mtp).
        self.mtp_unavailable: str | None = None
        # Pre-hc_head streams of the last forward's tokens [T, n, d] (MTP input).
        self.last_streams: torch.Tensor | None = None
        self.last_mtp_streams: torch.Tensor | None = None
        self._fp8_codecs: dict[str, RecordCodec] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def replay_depth(self) -> int:
        """Windowed layers a prefix hit must rebuild in bounded-replay mode: every decoder
        layer keeps a sliding window (groups.exact_replay_tokens turns this into tokens)."""
        return self.config.num_hidden_layers

    @property
    def attention_backend(self) -> str:
        return self.model.layers[0].self_attn.backend if len(self.model.layers) else ""

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention layer (MTP included) to backend `name` (layers/attention/registry.py)."""
        name = resolve_attention_backend(name)
        for module in self.modules():
            if isinstance(module, DeepseekV4Attention):
                module.backend = name

    # ------------------------------------------------------------------ forward
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, d] after hc_head and the final norm. A decode batch goes to
        `decode_forward` where the backend runs decode batches through the static path."""
        if self.static_decode(batch):
            return self.decode_forward(batch)
        step = V4Step(batch, self._packed_codecs(batch), self.batch_invariant)
        return self._run(step, batch)

    def static_decode(self, batch: ForwardBatch) -> bool:
        """Whether `batch` runs the capturable decode forward (host arrays only, no device
        read): a decode batch (registry's `is_decode_batch`) under a backend that sends those
        to the static path on this device."""
        # --batch-invariant keeps decode on V4Step: the static path reads every entry the
        # batch's widest block table holds, a reduction length set by the other requests.
        return (batch.num_tokens > 0 and not self.batch_invariant
                and static_decode(self.attention_backend, batch.positions.device)
                # A compiled forward is the captured decode step's (worker/capture_guard.py),
                # whose batches are decode batches: no check on the batch's data there.
                and (torch.compiler.is_compiling() or is_decode_batch(batch)))

    def decode_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` of a decode batch (every request one new token, no bounded replay) as a
        CUDA graph can record it: no host read, no host-built tensor, shapes fixed by the
        batch size and the block tables (layers/attention/v4_static.py; docs/cuda_graphs.md)."""
        return self._run(V4DecodeStep(batch, self._packed_codecs(batch)), batch)

    def decode_capturable(self, device: torch.device) -> bool:
        """On CUDA, when the attention backend sends decode batches to the static path and
        every routed-expert layer runs "grouped_mm" (no host sync) with no expert-parallel
        dispatcher or a capturable one (models/qwen3_moe/model.py's rule)."""
        return (device.type == "cuda" and static_decode(self.attention_backend, device)
                and all((m.ep is None or m.ep.capturable)
                        and m.resolved_impl(device, m.down_proj.dtype) == "grouped_mm"
                        for m in self.model.modules() if isinstance(m, RoutedExperts)))

    def _run(self, step: V4Step | V4DecodeStep, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)                          # [T, d]
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, step, batch.input_ids)                   # [T, n, d]
        self.last_streams = streams
        return self.model.norm(self.model.hc_head(streams))

    def mtp_forward(self, batch: ForwardBatch, streams: torch.Tensor,
                    next_token_ids: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP block `depth` for the batch's tokens -> hidden [T, d] (then compute_logits).

        streams [T, n, d]: the main model's `last_streams` (or, for depth > 0, the previous
        MTP block's `last_mtp_streams`) at the same positions; next_token_ids [T]: the token
        that follows each position. batch carries the positions and the MTP window cache.
        """
        if depth >= len(self.mtp):
            raise ValueError(f"MTP depth {depth} requested but the model has {len(self.mtp)} "
                             f"MTP block(s) (num_nextn_predict_layers)")
        step = V4Step(batch, self._packed_codecs(batch), self.batch_invariant)
        embeds = self.model.embed_tokens(next_token_ids)
        hidden, self.last_mtp_streams = self.mtp[depth].run(embeds, streams, step,
                                                            next_token_ids)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ KV cache
    def _packed_codecs(self, batch: ForwardBatch) -> dict[str, RecordCodec]:
        """Codecs of the caches this batch stores as quantised records (uint8 tensors:
        --kv-cache-dtype fp8). This step's own rows are used as computed; what later steps
        read back is the records' values (as vLLM: the fresh rows skip the round trip)."""
        if self._fp8_codecs is None:
            specs = {**self.kv_cache_specs("fp8"), **self.mtp_kv_cache_specs("fp8")}
            self._fp8_codecs = {n: codec_for(s.record_format, s.width, s.rope_dim)
                                for n, s in specs.items() if s.record_format != "raw"}
        caches = batch.kv_caches
        return {n: c for n, c in self._fp8_codecs.items()
                if n in caches and caches[n].dtype == torch.uint8}

    def _specs(self, kv_cache_dtype: str) -> tuple[KVCacheSpec, ...]:
        """(window, compressed, indexer) specs for one dtype choice; ratio filled later."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {kv_cache_dtype!r}")
        c = self.config
        dtype = self.dtype if kv_cache_dtype == "auto" else torch.bfloat16
        quant = kv_cache_dtype == "fp8"
        window = KVCacheSpec(CacheKind.SLIDING_WINDOW, "window", c.head_dim, dtype,
                             window=c.sliding_window,
                             record_format="fp8_ds_mla" if quant else "raw",
                             rope_dim=c.qk_rope_head_dim if quant else 0)
        compressed = KVCacheSpec(CacheKind.FULL, "compressed", c.head_dim, dtype,
                                 record_format="fp8_ds_mla" if quant else "raw",
                                 rope_dim=c.qk_rope_head_dim if quant else 0)
        indexer = KVCacheSpec(CacheKind.FULL, "indexer", c.index_head_dim, dtype,
                              record_format="mxfp4_index" if quant else "raw")
        return window, compressed, indexer

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """Per layer: window (all), compressed + state (CSA, HCA), indexer + indexer_state
        (CSA). State specs hold the per-position compressor inputs in fp32, with exactly the
        window the compressor reads back (2m for CSA, m' for HCA)."""
        c = self.config
        window, compressed, indexer = self._specs(kv_cache_dtype)
        specs: dict[str, KVCacheSpec] = {}
        for i, layer_type in enumerate(c.layer_types):
            p = f"model.layers.{i}.self_attn."
            specs[p + "window"] = window
            if layer_type == SLIDING:
                continue
            m = c.compress_ratio(i)
            overlap = layer_type == CSA
            coff = 2 if overlap else 1
            specs[p + "compressed"] = dataclasses.replace(compressed, compress_ratio=m)
            specs[p + "state"] = KVCacheSpec(CacheKind.SLIDING_WINDOW, "state",
                                             2 * coff * c.head_dim, torch.float32,
                                             window=coff * m)
            if layer_type == CSA:
                specs[p + "indexer"] = dataclasses.replace(indexer, compress_ratio=m)
                specs[p + "indexer_state"] = KVCacheSpec(
                    CacheKind.SLIDING_WINDOW, "indexer_state", 4 * c.index_head_dim,
                    torch.float32, window=2 * m)
        return specs

    @property
    def num_mtp_blocks(self) -> int:
        return len(self.mtp)

    def mtp_kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """The MTP blocks' sliding-window caches (kept out of kv_cache_specs())."""
        window = self._specs(kv_cache_dtype)[0]
        return {f"mtp.{i}.self_attn.window": window for i in range(len(self.mtp))}

    # ------------------------------------------------------------------ weights
    def drop_mtp(self, reason: str) -> None:
        """Serve without the MTP block(s): the checkpoint has none although the config says
        num_nextn_predict_layers >= 1 (transformers does not implement MTP, so its
        save_pretrained writes no mtp.* tensors). MTP speculation then reports `reason`."""
        self.mtp = nn.ModuleList()
        self.mtp_unavailable = reason

    def _loadable(self) -> dict[str, torch.Tensor]:
        return self.state_dict(keep_vars=True)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (HF name, tensor) pairs into parameters/buffers (cast to their dtype)."""
        targets = self._loadable()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"DeepSeek-V4: unknown weight {name!r} (no such parameter; "
                                 f"MTP weights need num_nextn_predict_layers >= 1)")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"DeepSeek-V4: weight {name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of the main model; MTP excluded from both
        (see mtp_param_counts). Active counts routed experts at k/E of their weights and
        everything else (embedding and lm_head included) fully."""
        return self._counts(self.model.layers, [self.model.embed_tokens, self.model.norm,
                                                self.model.hc_head, self.lm_head],
                            tied=self.config.tie_word_embeddings)

    def mtp_param_counts(self) -> tuple[int, int]:
        """(total, active per token) of the MTP block(s), embedding/lm_head (shared) excluded."""
        return self._counts(self.mtp, [], tied=False)

    def _counts(self, blocks: nn.Module, others: list[nn.Module], tied: bool
                ) -> tuple[int, int]:
        c = self.config
        total = routed = 0
        for module in [blocks, *others]:
            for name, p in module.named_parameters():
                total += p.numel()
                if ".experts." in f".{name}":
                    routed += p.numel()
        if tied:
            total -= self.lm_head.weight.numel()
        active = total - routed + routed * c.num_experts_per_tok // c.n_routed_experts
        return total, active

