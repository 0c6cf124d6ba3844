"""What a layer caches, described so the engine can size, group and page it.

Glossary
- position: a token's index in its request (0-based).
- entry: one cached record. A FULL spec with compress_ratio m holds one entry per m positions
  (entry w summarises positions [w*m, (w+1)*m)); m == 1 is classic full attention.
  A SLIDING_WINDOW spec holds one entry per position but only the last `window` positions are
  ever read, so its blocks can be freed once they leave the window.
- role: what the entries are ("window", "compressed", "indexer", "state", "indexer_state", "kv").
  It is for reports only; two specs that differ only by role would still be separate groups.
- record format: how one entry is laid out in bytes ("raw" = `width` elements of `dtype`;
  the quantised formats follow docs/deepseek_v4.md, "KV bytes per token").

Layers whose specs are equal form one KV cache group (see kv_cache/groups.py).

Cross-layer sharing (DeepSeek-V4.1): a cache name may map to `SharedKVSpec(owner)` instead of a
spec: that layer reads the owner's records (same tensor, same group, same block tables) and
owns no memory of its own, so pools, budgets and byte counts include each record once.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class CacheKind(str, enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


# Bytes of one entry for the quantised record formats (docs/deepseek_v4.md, "KV bytes per token").
# fp8_ds_mla: 448 FP8 nope + 64 bf16 rope (128 B) + 7 UE8M0 scales + 1 pad, for a 512-wide latent.
# fp8_index: 128 FP8 + one fp32 scale. mxfp4_index: 64 packed bytes + 4 UE8M0 scales.
# fp8_ue8m0 / nvfp4_ds_mla: DeepSeek-V4.1's window (528 B) and compressed (288 B) records.
# layers/kv_quant.py packs and unpacks them (fp8_index has no codec: not executable); a width
# that is not a multiple of the scale group has a zero-padded last group (ceil below).
def _fp8_ds_mla_bytes(width: int, rope_dim: int) -> int:
    nope = width - rope_dim
    return nope + 2 * rope_dim + math.ceil(nope / 64) + 1


def record_bytes(fmt: str, width: int, dtype: torch.dtype, rope_dim: int) -> int:
    if fmt == "raw":
        return width * torch.empty((), dtype=dtype).element_size()
    if fmt == "fp8_ds_mla":
        return _fp8_ds_mla_bytes(width, rope_dim)
    if fmt == "fp8_index":
        return width + 4
    if fmt == "mxfp4_index":
        return math.ceil(width / 2) + math.ceil(width / 32)
    if fmt == "fp8_ue8m0":        # DeepSeek-V4.1 window: every channel FP8, UE8M0 per 32
        return width + math.ceil(width / 32)
    if fmt == "nvfp4_ds_mla":     # DeepSeek-V4.1 compressed entry: e2m1, E4M3 scale per 16
        return math.ceil(width / 2) + math.ceil(width / 16)
    raise ValueError(f"unknown KV record format {fmt!r}")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    kind: CacheKind
    role: str
    width: int                 # elements per entry
    dtype: torch.dtype         # storage dtype of a raw entry (and of the dequantised view)
    compress_ratio: int = 1    # FULL: positions per entry
    window: int = 0            # SLIDING_WINDOW: positions [p - window + 1, p] are read at position p
    record_format: str = "raw"
    rope_dim: int = 0          # trailing rotary channels (the quantised MLA record keeps them bf16)

    def __post_init__(self) -> None:
        if self.kind is CacheKind.SLIDING_WINDOW and self.window < 1:
            raise ValueError(f"{self.role}: a sliding-window spec needs window >= 1")
        if self.compress_ratio < 1:
            raise ValueError(f"{self.role}: compress_ratio must be >= 1")

    @property
    def entry_bytes(self) -> int:
        return record_bytes(self.record_format, self.width, self.dtype, self.rope_dim)

    @property
    def grows_with_context(self) -> bool:
        return self.kind is CacheKind.FULL

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token of context; 0 for bounded (sliding-window) specs."""
        return self.entry_bytes / self.compress_ratio if self.grows_with_context else 0.0

    @property
    def bounded_bytes(self) -> int:
        """Bytes per request that do not grow with context (the window's entries)."""
        return 0 if self.grows_with_context else self.window * self.entry_bytes

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.compress_ratio:
            raise ValueError(
                f"block size {block_size} is not a multiple of compress ratio {self.compress_ratio}")
        return block_size // self.compress_ratio

    def page_bytes(self, block_size: int) -> int:
        return self.entries_per_block(block_size) * self.entry_bytes


@dataclass(frozen=True, slots=True)
class SharedKVSpec:
    """A cache name that is another cache's records: `owner` is the owning cache name."""

    owner: str


def split_shared(specs: dict[str, KVCacheSpec | SharedKVSpec]
                 ) -> tuple[dict[str, KVCacheSpec], dict[str, str]]:
    """(the owned specs, reader name -> owner name); an owner must be an owned spec."""
    owned = {n: s for n, s in specs.items() if isinstance(s, KVCacheSpec)}
    shared = {n: s.owner for n, s in specs.items() if isinstance(s, SharedKVSpec)}
    for name, owner in shared.items():
        if owner not in owned:
            raise ValueError(f"KV cache {name!r} shares {owner!r}, which is not a cache of "
                             f"its own (a shared cache must name an owning one)")
    return owned, shared
