"""Proposers are a registry keyed by speculative_config.method (spec_decode/decoder.py)."""
from __future__ import annotations

import dataclasses

import pytest

from wideserve.config import LoadConfig
from wideserve.spec_decode import decoder
from wideserve.config.speculative import METHODS, SpeculativeConfig
from wideserve.spec_decode.ngram import NgramProposer


def test_registry_covers_every_method() -> None:
    assert sorted(decoder.PROPOSERS) == sorted(METHODS)


def test_make_proposer_by_name_and_unknown_method() -> None:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert isinstance(decoder.make_proposer(cfg, None, LoadConfig(), 10, 64), NgramProposer)
    bad = dataclasses.replace(cfg)
    bad.method = "eagle"          # past the config's own check: the registry names the set
    with pytest.raises(ValueError, match="'eagle' has no proposer; registered: draft_model, "
                                         "dspark, mtp, ngram"):
        decoder.make_proposer(bad, None, LoadConfig(), 10, 64)
