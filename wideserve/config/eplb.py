"""EplbConfig, spelled like vLLM's `--eplb-config` JSON:

    --enable-eplb --eplb-config '{"window_size": 1000, "step_interval": 3000,
                                  "num_redundant_experts": 32, "log_balancedness": true}'

vLLM's keys: window_size (steps of load the policy sees), step_interval (steps between
rebalances), num_redundant_experts (extra physical slots per MoE layer), log_balancedness,
log_balancedness_interval, policy ("default" = vLLM's name for the DeepSeek algorithm, here
"auto"; or "global" / "hierarchical"), use_async (vLLM's background-thread exchange; here
the exchange always runs between steps, in pieces, so only false is accepted). Ours:
layers_per_step (MoE layers whose weights move per step while a rebalance runs) and
num_groups (expert groups for the hierarchical policy; default: the model's n_group or 1).

No torch import here: the CLI parses this before anything heavy loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wideserve.config.json_flag import json_object

POLICIES = ("default", "auto", "global", "hierarchical")


@dataclass(slots=True)
class EplbConfig:
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    policy: str = "default"
    use_async: bool = False
    layers_per_step: int = 1
    num_groups: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad key."""
        for name, low in (("window_size", 1), ("step_interval", 1),
                          ("num_redundant_experts", 0), ("log_balancedness_interval", 1),
                          ("layers_per_step", 1)):
            _check_int(name, getattr(self, name), low)
        if self.num_groups is not None:
            _check_int("num_groups", self.num_groups, 1)
        for name in ("log_balancedness", "use_async"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"eplb_config.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"eplb_config.policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if self.use_async:
            raise ValueError("eplb_config.use_async: not supported; wideserve moves expert "
                             "weights between steps, layers_per_step layers at a time, so "
                             "decode never stops without a background thread")

    @property
    def policy_name(self) -> str:
        return "auto" if self.policy == "default" else self.policy

    @classmethod
    def parse(cls, value: str | dict[str, Any] | EplbConfig | None) -> EplbConfig:
        """A JSON string, a dict, an EplbConfig, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, EplbConfig):
            return value
        return cls(**json_object(value, "eplb_config", cls))


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"eplb_config.{name} must be an integer >= {low}, got {value!r}")
