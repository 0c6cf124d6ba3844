"""What the engine needs from a model: one contract, declared rather than probed.

Every model class registered in models/registry.py derives from `CausalLM` and implements its
abstract methods (the registry refuses a class that does not, naming what is missing). The
optional capabilities below have defaults that say "not supported"; a model that has one
overrides it. The engine, runner, speculative decoders, EPLB and the front end ask these
methods; none of them discovers a capability with getattr/hasattr (STYLE.md item 10).

Glossary:
  MTP block   a next-token-prediction block run after the main forward (V4: `mtp_forward`,
              used by spec_decode/mtp.py; V4.1: the DSpark drafter stages, spec_decode/dspark.py)
  replay      rebuilding the sliding windows of a prefix-cache hit by recomputing the last
              `replay_depth` windowed layers' tokens (kv_cache/groups.exact_replay_tokens)
  capture     recording the decode forward once and replaying it (worker/decode_capture.py)
"""
from __future__ import annotations

from abc import ABCMeta, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import torch
from torch import nn

from wideserve.kv_cache.spec import KVCacheSpec
from wideserve.types.forward_batch import ForwardBatch
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.linear import FunctionalLinear, WeightPack, use_invariant_linears
from wideserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from wideserve.config import KernelConfig
    from wideserve.types.multimodal import ImageInput


class CausalLM(nn.Module, metaclass=ABCMeta):
    """Base of every model: the required surface (abstract) and optional capabilities."""

    # A dataclass with `from_dict(config_json: dict)`; `__init__(config)` builds the model on
    # the current default device/dtype.
    config_class: ClassVar[type]
    # Parameter name components that stay fp32 whatever the load dtype (worker/model_loader.py
    # build_model; like HF's _keep_in_fp32_modules_strict).
    keep_in_fp32: ClassVar[tuple[str, ...]] = ()
    # Whether the model has a V4-style MTP block (`mtp_forward`) / DSpark drafter stages.
    supports_mtp: ClassVar[bool] = False
    supports_dspark: ClassVar[bool] = False

    # ------------------------------------------------------------------ required
    @abstractmethod
    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """Cache name (e.g. "model.layers.3.self_attn.window") -> spec; the names key
        ForwardBatch.kv_caches. kv_cache_dtype: "auto" (model dtype), "bf16", or "fp8"
        (quantised records: FP8 window/compressed latents, MXFP4 indexer keys)."""

    @abstractmethod
    def param_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, one row per new token."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (HF-style name, tensor) pairs; return the names of parameters filled."""

    # ------------------------------------------------------------------ loading
    def keeps_quantised(self, name: str) -> bool:
        """Checkpoint tensors the reader passes on as stored, with their `.scale`
        (worker/weights.py); none by default."""
        return False

    def bind_tokenizer(self, model_dir: str | Path) -> None:
        """Called once after loading, for models whose forward reads the vocabulary."""

    def drop_mtp(self, reason: str) -> None:
        """Serve without the MTP block(s) (the checkpoint has none); models with MTP blocks
        remove them and remember `reason` as `mtp_unavailable`."""

    # ------------------------------------------------------------------ execution
    def tied_head_shape(self) -> tuple[int, int] | None:
        """(vocab, hidden) of an LM head that is the input embedding (tied; no nn.Linear of
        its own, so layers/kernel_table.py cannot see its GEMM); None: the head is a module."""
        return None

    def apply_kernel_config(self, kernels: KernelConfig) -> None:
        """Set the per-module CPU-op switches from the engine's KernelConfig (the norms' and
        the weight packs' here; models with more override and call this)."""
        self.batch_invariant = kernels.batch_invariant
        if self.functional_gemms:       # plain nn.Linear modules: invariant ones in the mode
            use_invariant_linears(self, kernels.batch_invariant)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.cpu_kernel = kernels.cpu_norm
            if isinstance(m, RoutedExperts):
                m.batch_invariant = kernels.batch_invariant
                m.lossless = kernels.lossless_experts == "on"   # "auto": engine_core decides
            for value in vars(m).values():
                if isinstance(value, (WeightPack, FunctionalLinear)):
                    value.cpu_kernel = kernels.cpu_gemm
                    value.batch_invariant = kernels.batch_invariant

    def compile_forward(self) -> bool:
        """Switch to the compiled forward (LoadConfig.enforce_eager=False); False when the
        model has no compiled path and stays eager."""
        return False

    def decode_capturable(self, device: torch.device) -> bool:
        """Whether a CUDA graph may record the decode forward on `device`: no host sync, no
        host-built per-step tensor, shapes fixed by the batch size (docs/cuda_graphs.md)."""
        return False

    def decode_staging(self, max_rows: int, device: torch.device) -> Any:
        """Host-computed inputs of a captured decode step (worker/decode_capture.py's
        DecodeStaging: written before each replay into static device buffers the forward
        reads from batch.extras), or None when the forward needs none (every model but
        DeepSeek-V4.1 with Engram layers, layers/engram.py)."""
        return None

    @property
    def replay_depth(self) -> int | None:
        """Windowed layers a prefix hit must rebuild in bounded-replay mode; None: every KV
        group (the engine's default)."""
        return None

    @property
    def supports_decoder_bounded_replay(self) -> bool:
        """Whether `enable_decoder_bounded_replay` applies (the engine turns it on then)."""
        return False

    def enable_decoder_bounded_replay(self) -> None:
        """--decoder-bounded-replay (DeepSeek-V4.1 only)."""
        raise ValueError(f"--decoder-bounded-replay applies to DeepSeek-V4.1 models only; "
                         f"this model is {type(self).__name__}")

    # ------------------------------------------------------------------ images
    @property
    def image_token_id(self) -> int | None:
        """The placeholder id of image positions when the model takes images (a vision
        tower was built), else None (worker/images.py, serving/openai/images.py)."""
        return None

    def embed_image(self, image: ImageInput) -> torch.Tensor:
        """One image span's embeddings [image.length, d] (models with image_token_id)."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    # ------------------------------------------------------------------ MTP / draft
    # Whether the model runs GEMMs as plain nn.Linear modules outside a WeightPack: under
    # --batch-invariant apply_kernel_config makes them layers/linear.py InvariantLinears
    # (functional GEMM sites hold a FunctionalLinear, which it switches like a WeightPack).
    functional_gemms: ClassVar[bool] = True
    batch_invariant: bool = False        # KernelConfig.batch_invariant (apply_kernel_config)

    # Why the MTP block is unavailable although the config asks for one (set by drop_mtp).
    mtp_unavailable: str | None = None

    @property
    def num_mtp_blocks(self) -> int:
        """MTP blocks (V4) or DSpark stages (V4.1) built and loaded."""
        return 0

    def mtp_kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """The MTP blocks' caches (kept out of kv_cache_specs())."""
        return {}

    def mtp_param_counts(self) -> tuple[int, int]:
        """(total, active per token) of the MTP block(s)."""
        return 0, 0

    def vision_param_count(self) -> int:
        """Parameters of a vision tower (0 without one); they run once per image."""
        return 0

    def dspark_kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """The DSpark drafter's context cache (supports_dspark models)."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    def dspark_draft(self, ids: torch.Tensor, features: torch.Tensor, anchor_pos: torch.Tensor,
                     ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """The DSpark stages over a block of ids per request -> states [B, Q, d]
        (spec_decode/dspark.py; supports_dspark models)."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    def dspark_head(self, states: torch.Tensor, previous: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, confidence logits) of the DSpark states (supports_dspark models)."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    # ------------------------------------------------------------------ experts (EPLB)
    def num_expert_groups(self) -> int:
        """Expert groups for EPLB's hierarchical policy (worker/eplb_manager.py)."""
        return 1


def missing_methods(cls: type) -> list[str]:
    """What a model class lacks to satisfy the contract (empty: it does)."""
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        return [f"derive from {CausalLM.__module__}.CausalLM"]
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if "config_class" not in {k for c in cls.__mro__ for k in vars(c)}:
        missing.append("config_class")
    return missing


def check_model_class(cls: Any) -> None:
    """Raise a TypeError naming what a model class lacks (models/registry.py)."""
    missing = missing_methods(cls)
    if missing:
        raise TypeError(f"model class {getattr(cls, '__name__', cls)!r} does not implement "
                        f"the model contract (wideserve/models/interface.py): missing "
                        f"{', '.join(missing)}")
