"""Small DeepSeek-V4 attention ops: the backend registry, the indexer's deterministic top-k
(both of its paths against the stable sort that defines it) and the complex-multiply rope
against the readable one."""
from __future__ import annotations

import pytest
import torch

from wideserve.layers.attention import indexer
from wideserve.layers.attention.registry import (ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND,
                                                 ENV_VAR, get_attention_backend,
                                                 resolve_attention_backend)
from wideserve.layers.attention.indexer import index_topk, keyed_topk, stable_topk_indices
from wideserve.layers.rope_interleaved import apply_rope, rope_cis, rotate
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from wideserve.models.deepseek_v4.config import DeepseekV4Config


def test_registry_default_env_and_errors(monkeypatch):
    assert set(ATTENTION_BACKENDS) == {"reference", "batched", "static"}
    assert DEFAULT_ATTENTION_BACKEND == "batched"
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_attention_backend() == "batched"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_attention_backend() == "reference"
    assert resolve_attention_backend("batched") == "batched"       # explicit beats env
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_attention_backend()
    with pytest.raises(ValueError, match="not an attention backend"):
        resolve_attention_backend("flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
    with pytest.raises(TypeError):
        ATTENTION_BACKENDS["x"] = ATTENTION_BACKENDS["batched"]    # read-only table


def test_model_picks_and_switches_backend(monkeypatch):
    from models import v4_configs as cfgs

    cfg = DeepseekV4Config.from_dict({**cfgs.C, "num_nextn_predict_layers": 1})
    monkeypatch.setenv(ENV_VAR, "reference")
    assert DeepseekV4ForCausalLM(cfg).attention_backend == "reference"
    model = DeepseekV4ForCausalLM(cfg, attention_backend="batched")
    attn = [m.self_attn for m in [*model.model.layers, *model.mtp]]
    assert {a.backend for a in attn} == {"batched"}
    model.set_attention_backend("reference")
    assert {a.backend for a in attn} == {"reference"}
    with pytest.raises(ValueError):
        model.set_attention_backend("nope")


def _tie_heavy(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Scores like the indexer's: many exact zeros of both signs, repeats, -inf padding."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, shape, generator=g).float() * 0.5
    s = torch.where(torch.rand(shape, generator=g) < 0.3, 0.0, s)
    s = torch.where(torch.rand(shape, generator=g) < 0.2, -0.0, s)
    s = torch.where(torch.rand(shape, generator=g) < 0.1, float("-inf"), s)
    big = torch.randn(shape, generator=g) * 1e30
    return torch.where(torch.rand(shape, generator=g) < 0.1, big, s)


@pytest.mark.parametrize("n,k", [(7, 3), (40, 16), (300, 17), (3000, 512)])
def test_topk_paths_equal_the_stable_sort(n, k):
    for seed in range(5):
        s = _tie_heavy((6, 2, n), seed)
        ref = stable_topk_indices(s, k)
        assert torch.equal(keyed_topk(s, k), ref)
        assert torch.equal(index_topk(s, k), ref)
    # Denormals and the extremes of the float range keep their order too.
    s = torch.tensor([[1e-45, -1e-45, 0.0, -0.0, 3.4e38, -3.4e38, float("inf"), 1e-45]])
    assert torch.equal(keyed_topk(s, 8), stable_topk_indices(s, 8))


def test_index_topk_switches_path_at_the_threshold(monkeypatch):
    calls = []
    monkeypatch.setattr(indexer, "keyed_topk", lambda s, k: calls.append(k) or s[..., :k])
    index_topk(torch.zeros(2, indexer.SORT_BELOW - 1), 4)
    assert not calls
    index_topk(torch.zeros(2, indexer.SORT_BELOW), 4)
    assert calls == [4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_apply_rope(dtype):
    g = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(37, 8, generator=g), torch.randn(37, 8, generator=g)
    for shape in [(37, 64), (37, 4, 64), (37, 2, 3, 16)]:
        x = torch.randn(shape, generator=g).to(dtype)
        for inverse in (False, True):
            out = rotate(x, rope_cis(cos, sin, inverse))
            ref = apply_rope(x, cos, sin, inverse)
            assert out.dtype == dtype
            assert torch.allclose(out.float(), ref.float(), rtol=0, atol=1e-6)
    # A view whose rope slice starts at an odd offset (not viewable as complex) still works.
    x = torch.randn(37, 65, generator=g)[:, 1:]
    assert torch.allclose(rotate(x, rope_cis(cos, sin)), apply_rope(x, cos, sin), atol=1e-6)
