"""--enforce-eager / LoadConfig.enforce_eager: the flag parses as vLLM's, the device default is
eager on the CPU, and a model without a compiled path stays eager with a warning."""
from __future__ import annotations

import argparse
import logging

import torch

from wideserve.engine.engine_core import _compile_model
from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from wideserve.models.interface import CausalLM


def test_flag_parses_to_load_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], None), (["--enforce-eager"], True), (["--no-enforce-eager"], False)):
        assert engine_config_from_args(parser.parse_args(argv)).load.enforce_eager is want


class _Eager(CausalLM):
    """A model with the contract's defaults: no compiled path."""

    config_class = object

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict:
        return {}

    def param_counts(self) -> tuple[int, int]:
        return 0, 0

    def forward(self, batch):
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def load_weights(self, weights) -> set[str]:
        return set()


class _Compilable(_Eager):
    def __init__(self) -> None:
        super().__init__()
        self.compiled = 0

    def compile_forward(self) -> bool:
        self.compiled += 1
        return True


def test_device_default_and_models_without_a_compiled_path(caplog) -> None:
    cpu = torch.device("cpu")
    m = _Compilable()
    assert not _compile_model(m, None, cpu) and m.compiled == 0      # CPU default: eager
    assert not _compile_model(m, True, cpu) and m.compiled == 0
    assert _compile_model(m, False, cpu) and m.compiled == 1
    with caplog.at_level(logging.WARNING):
        assert not _compile_model(_Eager(), False, cpu)
    assert "no compiled forward" in caplog.text
