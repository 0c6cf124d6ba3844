"""Fake specs and requests for the KV cache tests (no model needed)."""
from __future__ import annotations

import torch

from wideserve.config import CacheConfig
from wideserve.kv_cache.groups import KVCacheConfig, build_kv_cache_config
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams

SLIDING, FULL = CacheKind.SLIDING_WINDOW, CacheKind.FULL


def v4_specs(n_swa: int = 2, n_csa: int = 21, n_hca: int = 20, quantised: bool = False,
             window: int = 128, head_dim: int = 512, index_head_dim: int = 128,
             rope_dim: int = 64) -> dict[str, KVCacheSpec]:
    """A DeepSeek-V4-like layer mix: every layer a window; CSA (ratio 4) adds compressed +
    indexer entries and two compressor states (window 8); HCA (ratio 128) adds compressed
    entries and a state of window 128."""
    bf16 = torch.bfloat16
    kv_fmt = "fp8_ds_mla" if quantised else "raw"
    ix_fmt = "mxfp4_index" if quantised else "raw"
    win = KVCacheSpec(SLIDING, "window", head_dim, bf16, window=window, record_format=kv_fmt,
                      rope_dim=rope_dim)
    specs: dict[str, KVCacheSpec] = {}
    kinds = ["swa"] * n_swa + ["csa"] * n_csa + ["hca"] * n_hca
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}.self_attn."
        specs[p + "window"] = win
        if kind == "swa":
            continue
        m, coff = (4, 2) if kind == "csa" else (128, 1)
        specs[p + "compressed"] = KVCacheSpec(FULL, "compressed", head_dim, bf16,
                                              compress_ratio=m, record_format=kv_fmt,
                                              rope_dim=rope_dim)
        specs[p + "state"] = KVCacheSpec(SLIDING, "state", 2 * coff * head_dim, torch.float32,
                                         window=coff * m)
        if kind == "csa":
            specs[p + "indexer"] = KVCacheSpec(FULL, "indexer", index_head_dim, bf16,
                                               compress_ratio=m, record_format=ix_fmt)
            specs[p + "indexer_state"] = KVCacheSpec(SLIDING, "indexer_state",
                                                     4 * index_head_dim, torch.float32,
                                                     window=coff * m)
    return specs


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def make_manager(specs: dict[str, KVCacheSpec], num_blocks: int, block_size: int = 256,
                 mode: str = "keep", replay_tokens: int | None = None,
                 max_model_len: int = 1 << 20, enable_prefix_caching: bool = True,
                 ) -> tuple[KVCacheManager, KVCacheConfig]:
    cc = CacheConfig(block_size=block_size, num_blocks_override=num_blocks,
                     prefix_window_mode=mode, enable_prefix_caching=enable_prefix_caching)
    cfg = build_kv_cache_config(specs, cc)
    return KVCacheManager(cfg, cc, max_model_len, replay_tokens=replay_tokens), cfg


def run_prefill(mgr: KVCacheManager, req: Request, chunk: int | None = None) -> None:
    """Admit `req` at its prefix hit and compute its whole token list in chunks, the way the
    scheduler does (allocate, then advance num_computed_tokens)."""
    hit_blocks, hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - hit if chunk is None else min(chunk, req.num_tokens - hit)
    assert mgr.allocate_slots(req, n, hit_blocks, hit) is not None
    req.num_computed_tokens = hit + n
    while req.num_computed_tokens < req.num_tokens:
        n = req.num_tokens - req.num_computed_tokens
        n = n if chunk is None else min(chunk, n)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
