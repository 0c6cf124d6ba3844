"""DeepSeek-V4.1 attention is on the attention registry (kind "v41"): its layer takes its ops
from there, the CSA2 select and V4's batched attend."""
from __future__ import annotations

import pytest

from wideserve.layers.attention import registry, v41_batched, v4_batched


def test_v41_backend_is_registered_with_the_shared_attend(monkeypatch) -> None:
    monkeypatch.setenv(registry.ENV_VAR, "reference")     # a knob of the other kinds only
    assert registry.resolve_v41_attention_backend() == "batched"
    ops = registry.get_v41_attention_backend("batched")
    assert ops.select is v41_batched.select and ops.attend is v4_batched.attend
    with pytest.raises(ValueError, match="unknown DeepSeek-V4.1 attention backend 'reference'"):
        registry.resolve_v41_attention_backend("reference")

