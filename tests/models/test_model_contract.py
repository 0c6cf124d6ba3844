"""The model contract (models/interface.py): every registered class implements it, a class
that misses part of it is refused at registration with the missing names, and the optional
capabilities default to "not supported"."""
from __future__ import annotations

import pytest
import torch

from wideserve.models import registry
from wideserve.models.interface import CausalLM, check_model_class, missing_methods


def test_every_registered_architecture_implements_the_contract() -> None:
    for arch in registry.supported_architectures():
        cls = registry.resolve_model_class({"architectures": [arch]})
        assert issubclass(cls, CausalLM) and missing_methods(cls) == []


class _Partial(CausalLM):
    config_class = object

    def forward(self, batch):
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_a_class_missing_methods_is_refused_naming_them(monkeypatch) -> None:
    with pytest.raises(TypeError, match="missing kv_cache_specs, load_weights, param_counts"):
        check_model_class(_Partial)
    with pytest.raises(TypeError, match="derive from wideserve.models.interface.CausalLM"):
        check_model_class(torch.nn.Linear)
    monkeypatch.setitem(registry._ARCHITECTURES, "PartialForCausalLM",
                        (__name__, "_Partial"))
    with pytest.raises(TypeError, match="'_Partial' does not implement the model contract"):
        registry.resolve_model_class({"architectures": ["PartialForCausalLM"]})


class _Minimal(_Partial):
    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict:
        return {}

    def param_counts(self) -> tuple[int, int]:
        return 1, 1

    def load_weights(self, weights) -> set[str]:
        return set()


def test_optional_capabilities_default_to_unsupported() -> None:
    m = _Minimal()
    assert not m.supports_mtp and not m.supports_dspark and m.num_mtp_blocks == 0
    assert m.mtp_kv_cache_specs() == {} and m.mtp_param_counts() == (0, 0)
    assert m.mtp_unavailable is None and m.replay_depth is None
    assert not m.supports_decoder_bounded_replay
    assert not m.compile_forward() and not m.decode_capturable(torch.device("cpu"))
    assert not m.keeps_quantised("x.weight") and m.num_expert_groups() == 1
    with pytest.raises(ValueError, match="applies to DeepSeek-V4.1 models only; this model "
                                         "is _Minimal"):
        m.enable_decoder_bounded_replay()
    with pytest.raises(NotImplementedError, match="_Minimal has no DSpark drafter"):
        m.dspark_kv_cache_specs()
