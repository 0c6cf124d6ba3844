"""EP dispatchers are a registry of EPDispatcher implementations (layers/ep_dispatch.py), picked
by ParallelConfig.ep_dispatcher."""
from __future__ import annotations

import pytest
import torch

from wideserve.config import ParallelConfig
from wideserve.layers import ep_dispatch as ep


def test_default_dispatcher_is_registered() -> None:
    assert ep.EP_DISPATCHERS[ParallelConfig().ep_dispatcher] is ep.AllToAllDispatcher
    disp = ep.make_dispatcher("all_to_all", None, 0, 1, 2, torch.device("cpu"))
    assert isinstance(disp, ep.AllToAllDispatcher) and disp.num_local == 2


def test_unknown_and_duplicate_names(monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown EP dispatcher 'deepep'; registered: "
                                         "all_to_all"):
        ep.make_dispatcher("deepep", None, 0, 1, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="'all_to_all' is already registered"):
        ep.register_dispatcher("all_to_all", ep.AllToAllDispatcher)
    monkeypatch.setattr(ep, "EP_DISPATCHERS", dict(ep.EP_DISPATCHERS))
    ep.register_dispatcher("mine", ep.AllToAllDispatcher)
    assert isinstance(ep.make_dispatcher("mine", None, 0, 1, 2, torch.device("cpu")),
                      ep.AllToAllDispatcher)
