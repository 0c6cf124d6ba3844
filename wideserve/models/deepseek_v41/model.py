"""DeepSeek-V4.1 causal LM over wideserve's paged varlen batch (docs/deepseek_v41.md).

Differences from V4 (models/deepseek_v4/model.py), all in this file or layers/v41_attention.py and
layers/engram.py: CSA2 attention with cross-layer KV sharing (full / reindex / reuse layers
and the two-level indexer), no per-head q norm, single-pass mHC (each site collapses the
streams with the previous site's `pre`; the first with stream 0; no hc_head), Engram memory
at some layers, and score-routed MoE only (the V4 MoE block with hash routing off).

Parameter names are those of the reference implementation's state_dict (`model.layers.{i}.
attn.wq_a.weight`, `model.layers.{i}.ffn.experts...`, `lm_head.weight`), except the routed
experts, which use wideserve's `RoutedExperts` layout; `load_weights` also takes the official
DeepSeek names (`layers.{i}.attn.wq_a.weight`, `embed.weight`, `hc_attn_fn`, per-expert w1/w2/w3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn

from wideserve.kv_cache.spec import CacheKind, KVCacheSpec, SharedKVSpec
from wideserve.types.forward_batch import ForwardBatch
from wideserve.types.multimodal import ImageInput
from wideserve.models.deepseek_v41.attention import CSA2State, DeepseekV41Attention
from wideserve.layers.attention.paged_decode_static import is_decode_batch
from wideserve.layers.attention.registry import resolve_v41_attention_backend, static_decode
from wideserve.layers.attention.v4_static import V4DecodeStep
from wideserve.layers.attention.v4_step import V4Step
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.engram import Engram, EngramStaging, NgramHasher, compressed_token_map
from wideserve.layers.kv_quant import RecordCodec
from wideserve.layers.moe import DeepseekV4MoE
from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope_interleaved import RotaryTable
from wideserve.models.deepseek_v41.common import SinglePassHC, collapse, expand
from wideserve.models.deepseek_v41.common import place_weight
from wideserve.models.deepseek_v41.config import FULL, SWA, DeepseekV41Config
from wideserve.models.deepseek_v41.names import (ENGRAM_TABLE, VISION_NAMES,
                                                 official_to_reference)
from wideserve.models.deepseek_v41.replay import plan_decoder_replay
from wideserve.models.deepseek_v41.vision import (IMAGE_POSITION, VisionRouter, add_vision_tower,
                                                 prepared_from_input, span_embeddings)
from wideserve.models.interface import CausalLM

# auto / fp8: the reference's records, packed (FP8 window, NVFP4 entries, MXFP4 keys);
# bf16 / raw: the same quantised values stored as bf16 / the model dtype (exact, more bytes).
KV_CACHE_DTYPES = ("auto", "fp8", "bf16", "raw")
ENGRAM_TOKENS = "model.engram.tokens"
# ForwardBatch.extras: a captured decode step's Engram rows, staged on the host (decode_staging).
ENGRAM_STAGED = "model.engram.staged"
# DSpark context: per position, the tap layers' pre-attention streams averaged over streams.
DSPARK_FEATURES = "model.dspark.features"
# Image inputs of a step (ForwardBatch.extras): the rows [K] int64 of image-span positions and
# their embeddings [K, d] (vision.span_embeddings), which replace the token embeddings there.
# Past the embedding those rows carry the id IMAGE_POSITION (vision.py), so that the router,
# Engram and the Engram token cache know them, and a text token that happens to equal
# image_token_id stays text (as in the reference, which marks spans, not ids).
IMAGE_ROWS = "model.image.rows"
IMAGE_EMBEDS = "model.image.embeds"


def rotary_tables(c: DeepseekV41Config) -> tuple[RotaryTable, RotaryTable]:
    """(main, compress): ratio-0 layers use plain RoPE at rope_theta; compressed layers use
    compress_rope_theta with frequency-only YaRN (no attention factor)."""
    main = RotaryTable({"rope_type": "default", "rope_theta": c.rope_theta}, c.qk_rope_head_dim)
    scaling = dict(c.rope_scaling or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "yarn":
        params = {**scaling, "rope_type": "yarn", "rope_theta": c.compress_rope_theta,
                  "attention_factor": 1.0}
    else:
        params = {"rope_type": "default", "rope_theta": c.compress_rope_theta}
    return main, RotaryTable(params, c.qk_rope_head_dim)


class DeepseekV41Block(nn.Module):
    """Names: attn, ffn, attn_norm, ffn_norm, attn_hc, ffn_hc, engram (some layers)."""

    def __init__(self, c: DeepseekV41Config, layer: int, main_rope: RotaryTable,
                 compress_rope: RotaryTable) -> None:
        super().__init__()
        self.attn = DeepseekV41Attention(c, layer, main_rope, compress_rope)
        self.ffn = DeepseekV4MoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts,
                                 c.num_experts_per_tok, c.scoring_func,
                                 c.routed_scaling_factor, c.swiglu_limit, False, c.vocab_size)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc = (c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = SinglePassHC(*hc)
        self.ffn_hc = SinglePassHC(*hc)
        # Image positions (id IMAGE_POSITION) skip Engram and route with bias_vl.
        self.has_vision = c.has_vision
        if c.has_vision:
            self.ffn.gate = VisionRouter(c.n_routed_experts, c.hidden_size,
                                         c.num_experts_per_tok, c.scoring_func,
                                         c.routed_scaling_factor)
        if layer in c.engram_layers:
            hash_heads = (c.engram_max_ngram_size - 1) * c.engram_n_heads
            rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
            self.engram = Engram(c.hidden_size, c.hc_mult, rows, c.engram_head_dim,
                                 hash_heads, c.rms_norm_eps)

    def tap(self, streams: torch.Tensor, engram_rows: torch.Tensor | None,
            input_ids: torch.Tensor) -> torch.Tensor:
        """DSpark's feature of this layer: the streams entering attention, averaged [T, d]."""
        if engram_rows is not None:
            streams = self._engram(streams, engram_rows, input_ids)
        return streams.float().mean(dim=1)

    def _engram(self, streams: torch.Tensor, rows: torch.Tensor,
                input_ids: torch.Tensor | None) -> torch.Tensor:
        """Engram's update, which image positions do not take (the reference zeroes their
        gate)."""
        out = self.engram(streams, rows)
        if not self.has_vision:
            return out
        return torch.where((input_ids == IMAGE_POSITION)[:, None, None], streams, out)

    def write_shared_kv(self, streams: torch.Tensor, pre: torch.Tensor, step: V4Step,
                        input_ids: torch.Tensor,
                        engram_rows: torch.Tensor | None) -> torch.Tensor:
        """A KV source's entries for every row of the step, before the decoder bounded
        replay cuts its queries (models/deepseek_v41/replay.py) -> the streams after Engram
        (pass engram_rows=None to `forward` then)."""
        if engram_rows is not None:
            streams = self._engram(streams, engram_rows, input_ids)
        self.attn.write_entries(self.attn_norm(collapse(streams, pre)), step)
        return streams

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, step: V4Step | V4DecodeStep,
                state: CSA2State, input_ids: torch.Tensor, engram_rows: torch.Tensor | None,
                write_entries: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, n, d], pre [T, n] (the previous site's) -> (streams, this FFN's pre).
        write_entries=False: `write_shared_kv` ran for this step."""
        if engram_rows is not None:
            streams = self._engram(streams, engram_rows, input_ids)
        attn_pre, post, comb = self.attn_hc.coefficients(streams)
        y = self.attn(self.attn_norm(self.attn_hc.collapse(streams, pre)), step, state,
                      write_entries)
        streams = self.attn_hc.expand(streams, post, comb, y)
        ffn_pre, post, comb = self.ffn_hc.coefficients(streams)
        y = self.ffn(self.ffn_norm(self.ffn_hc.collapse(streams, attn_pre)), input_ids)
        return self.ffn_hc.expand(streams, post, comb, y), ffn_pre


class DeepseekV41Model(nn.Module):
    """Names under `model.`: embed_tokens, layers, norm."""

    def __init__(self, c: DeepseekV41Config, main_rope: RotaryTable,
                 compress_rope: RotaryTable) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DeepseekV41Block(c, i, main_rope, compress_rope)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.has_vision:     # model.vision, model.aligner, model.image_{start,end,newline}
            add_vision_tower(self, c.vision, c.hidden_size)


class DeepseekV41ForCausalLM(CausalLM):
    config_class = DeepseekV41Config
    supports_dspark = True
    keep_in_fp32 = ("attn_hc", "ffn_hc", "sinks_param", "e_score_correction_bias",
                    "compressor.wkv", "compressor.wgate", "lm_head", "confidence_head")

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.main_rope, self.compress_rope = rotary_tables(config)
        self.model = DeepseekV41Model(config, self.main_rope, self.compress_rope)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=torch.float32)
        self._hasher: NgramHasher | None = None
        self._token_map: torch.Tensor | None = None
        self._token_map_host: np.ndarray | None = None
        self._codecs = self._record_codecs()
        # Decoder bounded replay (exact; the engine turns it on unless told not to): the last
        # KV source and the layers after it run only on the rows whose results are read
        # (models/deepseek_v41/replay.py).
        self.decoder_replay = False
        # DSpark drafter stages (`mtp.*`, models/deepseek_v41/dspark.py); dropped when the
        # checkpoint has none (drop_mtp).
        self.mtp = nn.ModuleList()
        self.mtp_unavailable: str | None = None
        if config.num_nextn_predict_layers > 0 and config.dspark_target_layer_ids and \
                max(config.dspark_target_layer_ids) < config.num_hidden_layers:
            from wideserve.models.deepseek_v41.dspark import build_stages, dspark_rope
            self.mtp = build_stages(config, dspark_rope(config))

    @property
    def supports_decoder_bounded_replay(self) -> bool:
        return bool(self.config.kv_source_layer_ids)

    def enable_decoder_bounded_replay(self) -> None:
        """--decoder-bounded-replay: the last KV source and the layers after it run only on
        the rows whose results are read (exact; docs/deepseek_v41.md)."""
        if not self.config.kv_source_layer_ids:
            raise ValueError("--decoder-bounded-replay: this DeepSeek-V4.1 config has no KV "
                             "source layers, so there is no decoder to bound")
        self.decoder_replay = True

    def drop_mtp(self, reason: str) -> None:
        """Serve without DSpark: the checkpoint has no mtp.* tensors."""
        self.mtp = nn.ModuleList()
        self.mtp_unavailable = reason

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def replay_depth(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_mtp_blocks(self) -> int:
        return len(self.mtp)

    # ------------------------------------------------------------------ Engram hashing
    def bind_tokenizer(self, model_dir: str | Path) -> None:
        """Engram's normalised vocabulary from the checkpoint's tokenizer.json (when the
        model has Engram layers and the file exists)."""
        path = Path(model_dir) / "tokenizer.json"
        if self.config.engram_layers and path.is_file():
            token_map, size = compressed_token_map(path.read_text())
            self.set_token_map(token_map, size)

    def set_token_map(self, token_map: list[int], size: int) -> None:
        c = self.config
        if size != c.engram_compressed_vocab_size:
            raise ValueError(f"Engram: the tokenizer normalises to {size} distinct tokens, the "
                             f"config says engram_compressed_vocab_size="
                             f"{c.engram_compressed_vocab_size} (the hashes depend on it)")
        self._token_map = torch.tensor(token_map, dtype=torch.int64)
        self._token_map_host = np.asarray(token_map, dtype=np.int64)    # decode_staging's
        self._hasher = NgramHasher(c.engram_layers,
                                   [c.engram_num_embeddings[c.engram_layer_ids.index(i)]
                                    for i in c.engram_layers],
                                   c.engram_max_ngram_size, c.engram_n_heads,
                                   c.engram_vocab_size, size,
                                   int(token_map[c.engram_pad_token_id]))

    def _ensure_hasher(self) -> NgramHasher:
        if self._hasher is None:
            c = self.config
            if c.engram_compressed_vocab_size != c.vocab_size:
                raise ValueError("DeepSeek-V4.1 Engram needs the checkpoint's tokenizer.json "
                                 "(its normalised vocabulary feeds the n-gram hashes)")
            self.set_token_map(list(range(c.vocab_size)), c.vocab_size)   # identity map
        return self._hasher

    def _engram_rows(self, step: V4Step, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Row ids [T, hash_heads] per Engram layer, from each token's n-gram (this step's
        tokens and the cached token history)."""
        hasher, c = self._ensure_hasher(), self.config
        step.write_window_rows(ENGRAM_TOKENS, input_ids.float()[:, None])
        flat, view = step.flat_cache(ENGRAM_TOKENS)
        T, dev = input_ids.shape[0], input_ids.device
        req, pos = step.token_req, step.token_pos
        tmap = self._device_token_map(dev)
        grams = []
        blocked = torch.zeros(T, dtype=torch.bool, device=dev)
        for s in range(hasher.max_ngram):
            p = pos - s
            in_step = p >= step.ctx[req]
            cached = ~in_step & (p >= step.lo[req]) & (p >= 0)
            rows = torch.from_numpy(np.where(in_step, np.arange(T) - s, 0)).to(dev)
            slots = view.entry_slots(torch.from_numpy(req).to(dev),
                                     torch.from_numpy(np.where(cached, p, 0)).to(dev))
            tok = torch.where(torch.from_numpy(in_step).to(dev), input_ids[rows],
                              flat[slots, 0].long())
            blocked = blocked | ~torch.from_numpy(in_step | cached).to(dev)
            if c.has_vision:     # n-grams stop at an image position, as at a pad
                blocked = blocked | (tok == IMAGE_POSITION)
            grams.append(torch.where(blocked, hasher.pad_id, tmap[tok.clamp(0, len(tmap) - 1)]))
        grams = torch.stack(grams, dim=1)                                     # [T, N]
        return [hasher(grams, i) for i in range(len(self.config.engram_layers))]

    def _engram_rows_decode(self, step: V4DecodeStep,
                            input_ids: torch.Tensor) -> list[torch.Tensor]:
        """`_engram_rows` of a decode batch on the static path: the token at p and the
        cached tokens at p-1 .. p-N+1 (positions below 0 are blocked), on the device."""
        hasher = self._ensure_hasher()
        step.write_window_rows(ENGRAM_TOKENS, input_ids.float()[:, None])
        flat, _ = step.flat_cache(ENGRAM_TOKENS)
        tmap = self._device_token_map(input_ids.device)
        grams = [tmap[input_ids.clamp(0, len(tmap) - 1)]]
        blocked = torch.zeros_like(input_ids, dtype=torch.bool)
        # (an image row's own Engram update is dropped: only earlier image positions block)
        image = IMAGE_POSITION if self.config.has_vision else None
        for s in range(1, hasher.max_ngram):
            p = step.positions - s
            tok = flat[step.slots(ENGRAM_TOKENS, p.clamp(min=0)), 0].long()
            blocked = blocked | (p < 0)
            if image is not None:
                blocked = blocked | (tok == image)
            grams.append(torch.where(blocked, hasher.pad_id, tmap[tok.clamp(0, len(tmap) - 1)]))
        grams = torch.stack(grams, dim=1)                                     # [R, N]
        return [hasher(grams, i) for i in range(len(self.config.engram_layers))]

    def decode_staging(self, max_rows: int, device: torch.device) -> EngramStaging | None:
        """The captured decode step's Engram rows, staged on the host before each replay
        (layers/engram.py, EngramStaging; worker/decode_capture.py): the captured forward
        then reads no host table. None without Engram layers."""
        c = self.config
        if not c.engram_layers:
            return None
        hasher = self._ensure_hasher()
        assert self._token_map_host is not None
        tables = [self.model.layers[i].engram.embed for i in c.engram_layers]
        return EngramStaging(ENGRAM_STAGED, hasher, self._token_map_host, tables, max_rows,
                             device)

    def _engram_staged(self, step: V4DecodeStep, input_ids: torch.Tensor,
                       staged: torch.Tensor) -> list[torch.Tensor]:
        """`_engram_rows_decode` with the rows staged [R, layers, heads, dim]: the token
        cache is still written (later prefill and eager steps read the history there)."""
        step.write_window_rows(ENGRAM_TOKENS, input_ids.float()[:, None])
        return list(staged.unbind(1))

    def _device_token_map(self, device: torch.device) -> torch.Tensor:
        """The Engram token map on `device`, copied once (a per-step copy from the host is
        what a captured graph must not contain)."""
        if self._token_map.device != device:
            self._token_map = self._token_map.to(device)
        return self._token_map

    # ------------------------------------------------------------------ forward
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, d] after the final collapse and norm. A decode batch goes to
        `decode_forward` where the backend runs decode batches through the static path."""
        # --batch-invariant keeps decode on V4Step (the static path's reduction lengths
        # follow the batch's widest block table).
        if (batch.num_tokens and not self.batch_invariant
                and static_decode(self.attention_backend, batch.positions.device)
                # A compiled forward is the captured decode step's (worker/capture_guard.py),
                # whose batches are decode batches: no check on the batch's data there.
                and (torch.compiler.is_compiling() or is_decode_batch(batch))):
            return self.decode_forward(batch)
        return self._run(V4Step(batch, self._codecs, self.batch_invariant), batch)

    def decode_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` of a decode batch (every request one new token, no bounded replay) as a
        CUDA graph can record it: no host read, no host-built tensor, shapes fixed by the
        batch size and the block tables (layers/attention/v4_static.py; docs/cuda_graphs.md).
        The DSpark taps are written as in `forward`."""
        return self._run(V4DecodeStep(batch, self._codecs), batch)

    @property
    def attention_backend(self) -> str:
        return next((m.backend for m in self.model.modules()
                     if isinstance(m, DeepseekV41Attention)), "")

    def set_attention_backend(self, name: str) -> None:
        """Switch every attention layer to backend `name` (registry kind "v41")."""
        name = resolve_v41_attention_backend(name)
        for m in self.model.modules():
            if isinstance(m, DeepseekV41Attention):
                m.backend = name

    def decode_capturable(self, device: torch.device) -> bool:
        """On CUDA, when the backend sends decode batches to the static path, every
        routed-expert layer runs "grouped_mm" with no expert-parallel dispatcher or a
        capturable one (models/qwen3_moe/model.py's rule). Engram layers read their host
        table only through the rows the captured step stages before the replay
        (`decode_staging`; docs/cuda_graphs.md)."""
        return (device.type == "cuda" and static_decode(self.attention_backend, device)
                and all((m.ep is None or m.ep.capturable)
                        and m.resolved_impl(device, m.down_proj.dtype) == "grouped_mm"
                        for m in self.model.modules() if isinstance(m, RoutedExperts)))

    def _run(self, step: V4Step | V4DecodeStep, batch: ForwardBatch) -> torch.Tensor:
        c = self.config
        ids = batch.input_ids
        x = self.model.embed_tokens(ids)
        if IMAGE_ROWS in batch.extras:
            rows = batch.extras[IMAGE_ROWS]
            x = x.index_copy(0, rows, batch.extras[IMAGE_EMBEDS].to(x.dtype))
            ids = ids.index_fill(0, rows, IMAGE_POSITION)
        streams = x[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], c.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0].fill_(1.0)         # (an op: `= 1` lifts a host scalar tensor)
        rows = []
        if c.engram_layers:
            staged = batch.extras.get(ENGRAM_STAGED) if step.static else None
            rows = (self._engram_staged(step, ids, staged) if staged is not None
                    else self._engram_rows_decode(step, ids) if step.static
                    else self._engram_rows(step, ids))
        engram_at = {layer: r for layer, r in zip(c.engram_layers, rows)}
        state = CSA2State()
        taps = (set(c.dspark_target_layer_ids) if DSPARK_FEATURES in batch.kv_caches
                else set())
        features = []
        replay = None
        if self.decoder_replay and not step.static:   # (a decode row has nothing to skip)
            replay = plan_decoder_replay(batch, step.token_req, step.token_pos, step.lo,
                                         c.sliding_window, max(c.kv_source_layer_ids),
                                         c.num_hidden_layers)
        for i, layer in enumerate(self.model.layers):
            engram, write_entries = engram_at.get(i), True
            stage = None if replay is None else replay.stages.get(i)
            if stage is not None:
                if layer.attn.mode == FULL:     # the last KV source: entries for every row
                    streams = layer.write_shared_kv(streams, pre, step, ids, engram)
                    engram, write_entries = None, False
                rows = stage.rows
                streams, pre, ids = streams[rows], pre[rows], ids[rows]
                features = [f[rows] for f in features]      # DSpark taps before it
                state = CSA2State(None if state.picks is None else state.picks[rows],
                                  None if state.candidates is None else state.candidates[rows])
                engram = None if engram is None else engram[rows]
                engram_at = {k: v[rows] for k, v in engram_at.items() if k > i}
                step = V4Step(stage.batch, self._codecs, self.batch_invariant)
            if i in taps:   # the streams entering layer i (after its Engram)
                features.append(layer.tap(streams, engram, ids))
            streams, pre = layer(streams, pre, step, state, ids, engram, write_entries)
        if features:
            step.write_window_rows(DSPARK_FEATURES, torch.cat(features, dim=-1))
        hidden = self.model.norm(collapse(streams, pre))
        if replay is None:
            return hidden
        # Rows whose results nobody reads have no output (replay.py).
        full = hidden.new_zeros(batch.num_tokens, hidden.shape[-1])
        return full.index_copy_(0, replay.exact_rows, hidden.index_select(0, replay.exact_at))

    def dspark_draft(self, ids: torch.Tensor, features: torch.Tensor, anchor_pos: torch.Tensor,
                     ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """The DSpark stages over a block per request: ids [B, Q] (anchor then noise tokens),
        features [B, C, taps * d] at ctx_pos [B, C] (valid where ctx_valid) -> the last
        stage's normalised states [B, Q, d] (models/deepseek_v41/dspark.py)."""
        from wideserve.models.deepseek_v41.dspark import draft_block
        return draft_block(self.mtp, self.config, self.model.embed_tokens(ids), features,
                           anchor_pos, ctx_pos, ctx_valid)

    def dspark_head(self, states: torch.Tensor, previous: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """states [..., d], previous token ids [...] -> (draft logits [..., V] fp32,
        confidence logits [...] fp32)."""
        from wideserve.models.deepseek_v41.dspark import draft_head
        return draft_head(self.mtp, states, previous, self.lm_head)

    def dspark_kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """The DSpark context window: W positions of tap features (taps * hidden each)."""
        c = self.config
        dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else self.dtype
        return {DSPARK_FEATURES: KVCacheSpec(
            CacheKind.SLIDING_WINDOW, "dspark_features",
            len(c.dspark_target_layer_ids) * c.hidden_size, dtype, window=c.sliding_window)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.float())

    # ------------------------------------------------------------------ KV cache
    def _record_codecs(self) -> dict[str, RecordCodec]:
        """Every window, compressed and indexer-key cache is quantised, however stored."""
        c = self.config
        codecs = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.attn."
            codecs[p + "window"] = RecordCodec("fp8", c.head_dim)
            if c.compress_ratio(i):
                codecs[p + "compressed"] = RecordCodec("nvfp4", c.head_dim)
                codecs[p + "indexer_keys"] = RecordCodec("mxfp4", c.index_head_dim)
        return codecs

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec | SharedKVSpec]:
        """Every layer owns its window; KV sources own their compressed entries, indexer keys
        and (ratio > 1) compressor state; reindex / reuse layers' compressed caches are the
        source's (SharedKVSpec: stored and counted once). Engram keeps the last
        engram_max_ngram_size token ids of each request (one cache for all its layers)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {kv_cache_dtype!r}")
        c = self.config
        dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else self.dtype
        packed = kv_cache_dtype in ("auto", "fp8")
        fmt = {"window": "fp8_ue8m0", "compressed": "nvfp4_ds_mla",
               "indexer": "mxfp4_index"} if packed else {}
        specs: dict[str, KVCacheSpec | SharedKVSpec] = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.attn."
            specs[p + "window"] = KVCacheSpec(CacheKind.SLIDING_WINDOW, "window", c.head_dim,
                                              dtype, window=c.sliding_window,
                                              record_format=fmt.get("window", "raw"))
            mode, m = c.layer_mode(i), c.compress_ratio(i)
            if mode == SWA:
                continue
            if mode != FULL:
                specs[p + "compressed"] = SharedKVSpec(
                    f"model.layers.{c.kv_source_of(i)}.attn.compressed")
                continue
            specs[p + "compressed"] = KVCacheSpec(
                CacheKind.FULL, "compressed", c.head_dim, dtype, compress_ratio=m,
                record_format=fmt.get("compressed", "raw"))
            specs[p + "indexer_keys"] = KVCacheSpec(
                CacheKind.FULL, "indexer", c.index_head_dim, dtype, compress_ratio=m,
                record_format=fmt.get("indexer", "raw"))
            if m > 1:
                specs[p + "compressor_state"] = KVCacheSpec(
                    CacheKind.SLIDING_WINDOW, "state", 2 * c.head_dim, torch.float32, window=m)
        if c.engram_layers:
            specs[ENGRAM_TOKENS] = KVCacheSpec(CacheKind.SLIDING_WINDOW, "engram_tokens", 1,
                                               torch.float32, window=c.engram_max_ngram_size)
        return specs

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """(name, tensor) pairs in the reference's or the official naming (module doc)."""
        targets = self.state_dict(keep_vars=True)
        loaded: set[str] = set()
        parts: dict[str, int] = {}
        fp8_tables: dict[str, torch.Tensor] = {}    # an FP8 Engram table until its scale
        for raw, tensor in weights:
            name = official_to_reference(raw, self.config.has_vision)
            if name is None:
                continue
            if name.startswith("mtp.") and not len(self.mtp):
                continue             # (the model was built without its DSpark stages)
            if name.endswith(ENGRAM_TABLE) and tensor.dtype == torch.float8_e4m3fn:
                fp8_tables[name] = tensor
                continue
            if name.endswith(".engram.embed.scale"):
                table = name.removesuffix(".scale") + ".weight"
                if table not in fp8_tables:
                    raise ValueError(f"DeepSeek-V4.1: {raw!r} comes without its FP8 table")
                self.get_submodule(table.removesuffix(".weight")).load_fp8(
                    fp8_tables.pop(table), tensor)
                loaded.add(table)
                continue
            done = place_weight(targets, name, raw, tensor, parts, "DeepSeek-V4.1")
            if done is not None:
                loaded.add(done)
        if fp8_tables:
            raise ValueError(f"DeepSeek-V4.1: FP8 Engram table {next(iter(fp8_tables))!r} has "
                             f"no .scale companion")
        return loaded

    def keeps_quantised(self, name: str) -> bool:
        """Checkpoint tensors the reader passes on as stored, with their `.scale`: Engram
        tables stay FP8 in host memory (HostTable.load_fp8); only gathered rows dequantise."""
        return name.endswith(ENGRAM_TABLE)

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token): routed experts count at k/E; an Engram table (in host
        memory) only with the rows a token gathers."""
        c = self.config
        total = routed = tables = 0
        for name, p in self.named_parameters():
            if name.startswith("mtp.") or VISION_NAMES.search(name.removeprefix("model.")):
                continue             # (the vision tower: vision_param_count)
            total += p.numel()
            if ".experts." in name:
                routed += p.numel()
            elif name.endswith(".engram.embed.weight"):
                tables += p.numel()
        gathered = (len(c.engram_layers) * (c.engram_max_ngram_size - 1) * c.engram_n_heads
                    * c.engram_head_dim)
        active = (total - routed - tables + routed * c.num_experts_per_tok // c.n_routed_experts
                  + gathered)
        return total, active

    @property
    def image_token_id(self) -> int | None:
        return self.config.image_token_id if self.config.has_vision else None

    def embed_image(self, image: ImageInput) -> torch.Tensor:
        return span_embeddings(self.model, prepared_from_input(image))

    def vision_param_count(self) -> int:
        """Parameters of the vision tower (0 without one); they run once per image."""
        return sum(p.numel() for n, p in self.named_parameters()
                   if VISION_NAMES.search(n.removeprefix("model.")))
