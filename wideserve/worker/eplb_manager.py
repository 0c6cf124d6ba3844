"""EPLB for an engine: one ExpertBalancer for the target model's MoE layers and one for the
draft's (the MTP block's MoE, or a draft model's), tracked and rebalanced separately: the
draft sees a different token mix (one layer, every drafted position) and its own skew."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from wideserve.worker.eplb_balancer import EpGroup, ExpertBalancer
from wideserve.config.eplb import EplbConfig
from wideserve.worker.expert_shard import routed_experts, stack_of
from wideserve.layers.experts import RoutedExperts

logger = logging.getLogger(__name__)


def moe_layers(module: nn.Module, mtp: bool | None = None) -> list[RoutedExperts]:
    """The routed-expert layers of a model, in module order; mtp=True/False keeps only the
    MTP block's (`mtp.*`) or only the others, None keeps all."""
    return [m for name, m in routed_experts(module)
            if mtp is None or (stack_of(name) == "draft") == mtp]


def _num_groups(model: nn.Module, config: EplbConfig, stack: str, num_experts: int) -> int:
    """Expert groups of one stack for the hierarchical policy. A draft stack with its own
    expert count (DSpark: 128 against the target's 384) that the groups do not divide is
    balanced as one group (the global policy); the target's must divide (policy.py says so)."""
    groups = config.num_groups if config.num_groups is not None else model.num_expert_groups()
    return groups if stack == "target" or num_experts % groups == 0 else 1


class EplbManager:
    def __init__(self, config: EplbConfig, model: nn.Module, spec: Any,
                 device: torch.device, ep: EpGroup | None = None) -> None:
        """model: the target; spec: the engine's SpecDecoder or None (its MTP block or
        draft model is balanced as "draft")."""
        ep = ep or EpGroup()
        self.config = config
        self.balancers: dict[str, ExpertBalancer] = {}
        target = moe_layers(model, mtp=False)
        if not target:
            raise ValueError("--enable-eplb: the model has no routed-expert (MoE) layers")
        draft_owner, draft = _draft_layers(model, spec)
        for name, layers, owner in (("target", target, model), ("draft", draft, draft_owner)):
            if layers:
                self.balancers[name] = ExpertBalancer(
                    name, layers, layers[0].num_experts, config, ep, device,
                    num_groups=_num_groups(owner, config, name,
                                           layers[0].num_experts))
        if ep.size == 1:
            logger.info("EPLB with one expert-parallel rank: ranks are trivially balanced; "
                        "redundant experts and rebalances still run (useful for testing)")

    def step(self, dummy: bool = False) -> None:
        """Once per engine step, on every EP rank (dummy steps too)."""
        for b in self.balancers.values():
            b.step(dummy)

    def close(self) -> None:
        """The engine stopped: let go of the EP process group (engine/dp_engine.py)."""
        for b in self.balancers.values():
            b.ep.group = None

    def verify_weights(self) -> None:
        for b in self.balancers.values():
            b.verify_weights()

    def stats(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(b.stats) for name, b in self.balancers.items()}


def _draft_layers(model: nn.Module, spec: Any) -> tuple[nn.Module | None, list[RoutedExperts]]:
    """The MoE layers the speculative proposer runs: the target's MTP block (method mtp) or
    DSpark stages (method dspark, DeepSeek-V4.1: `mtp.*` too, with their own expert count
    and top-k), a draft model's (method draft_model), none otherwise."""
    method = spec.config.method if spec is not None else None
    if method in ("mtp", "dspark"):
        return model, moe_layers(model, mtp=True)
    if method == "draft_model":
        draft = spec.proposer.model
        return draft, moe_layers(draft)
    return None, []
