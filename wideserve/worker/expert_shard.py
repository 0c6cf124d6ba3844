"""Which routed experts a rank holds, and loading only those (docs/distributed.md).

Without redundant experts, physical expert p = logical expert p, and rank r of an EP group of
size N holds the contiguous block [r*L, (r+1)*L) with L = E / N. Each MoE stack is sharded on
its own terms: the target's layers with their E, a draft's (DeepSeek-V4.1's DSpark stages or
an MTP block, `mtp.*`) with its own (DSpark: 128 experts top-3 against the target's 384
top-6), so L differs between stacks (`moe_stacks`; one EP dispatcher serves both). `shard_experts` shrinks every
`RoutedExperts` of a model built on the meta device to its L local rows before the parameters
are materialised; `ExpertShardFilter` then slices checkpoint tensors to those rows on their way
into the model (fused [E, ...] tensors and their quantisation scales; per-expert tensors of
other ranks are skipped and local ones renumbered). Shared experts, routers and every other
weight are replicated. EPLB (issue 12) replaces the identity map with replicas; the owner of a
physical slot is still p // L.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from wideserve.worker.dummy_weights import dummy_tensor

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)$")
_FUSED_LEAF = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>[^.]+)$")


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    num_experts: int             # logical experts of a layer
    ep_size: int
    ep_rank: int
    num_redundant: int = 0       # EPLB's extra physical slots (docs/eplb.md)
    stack: str = "target"        # "target" or "draft" (error messages)

    def __post_init__(self) -> None:
        if self.num_physical % self.ep_size:
            raise ValueError(f"--enable-expert-parallel: the {self.stack}'s "
                             f"{self.num_experts} experts"
                             + (f" + {self.num_redundant} redundant" if self.num_redundant
                                else "")
                             + f" do not split evenly over data_parallel_size {self.ep_size}")

    @property
    def num_physical(self) -> int:
        return self.num_experts + self.num_redundant

    @property
    def num_local(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def start(self) -> int:
        return self.ep_rank * self.num_local

    @property
    def slot_experts(self) -> list[int]:
        """The logical expert loaded into each local slot: before any rebalance physical
        slot p holds expert p % E (identity; redundant slots wrap around)."""
        return [(self.start + i) % self.num_experts for i in range(self.num_local)]

    def local_slots(self, expert: int) -> list[int]:
        return [i for i, e in enumerate(self.slot_experts) if e == expert]


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every routed-experts module (target layers and MTP layers), in module order."""
    from wideserve.layers.experts import RoutedExperts
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def stack_of(name: str) -> str:
    """The MoE stack a routed-experts module belongs to: "draft" for the `mtp.*` modules
    (an MTP block, DSpark stages), "target" otherwise."""
    return "draft" if name.startswith(("mtp.", "model.mtp.")) else "target"


def moe_stacks(model: nn.Module) -> dict[str, list[nn.Module]]:
    """{"target": [...], "draft": [...]} routed-experts modules per stack, module order."""
    stacks: dict[str, list[nn.Module]] = {"target": [], "draft": []}
    for name, experts in routed_experts(model):
        stacks[stack_of(name)].append(experts)
    return stacks


def shard_experts(model: nn.Module, ep_size: int, ep_rank: int, num_redundant: int = 0
                  ) -> dict[str, ExpertPlacement]:
    """Shrink each RoutedExperts (parameters still on meta) to this rank's experts.
    Returns {module name: placement} for the loader."""
    placements: dict[str, ExpertPlacement] = {}
    for name, experts in routed_experts(model):
        place = ExpertPlacement(experts.num_experts, ep_size, ep_rank, num_redundant,
                                stack_of(name))
        for pname, param in list(experts.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == experts.num_experts:
                local = torch.empty((place.num_local, *param.shape[1:]), dtype=param.dtype,
                                    device=param.device)
                setattr(experts, pname, nn.Parameter(local, requires_grad=False))
        experts.num_local_experts = place.num_local
        experts.expert_offset = place.start
        # Under EP the load counters count the rows this rank routes to every physical
        # expert (all ranks'), so EPLB's all-reduce of them gives each expert's global load.
        experts.expert_load = torch.zeros(place.num_physical, dtype=torch.int64,
                                          device=experts.expert_load.device)
        placements[name] = place
    return placements


class ExpertShardFilter:
    """Wraps a checkpoint's (name, tensor) stream: only this rank's experts get through."""

    def __init__(self, placements: dict[str, ExpertPlacement]) -> None:
        self.placements = placements
        self.renamed: dict[str, str] = {}         # new name -> checkpoint name (for errors)

    def _placement(self, prefix: str) -> ExpertPlacement | None:
        # checkpoint prefixes with or without the model's `model.` (V4.1's official names)
        return (self.placements.get(prefix) or self.placements.get(prefix.removeprefix("model."))
                or self.placements.get("model." + prefix))

    def __call__(self, tensors: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            m = _PER_EXPERT.match(name)
            if m and (place := self._placement(m["prefix"])) is not None:
                for slot in place.local_slots(int(m["expert"])):
                    new = f"{m['prefix']}.{slot}.{m['rest']}"
                    self.renamed[new] = name
                    yield new, tensor
                continue
            m = _FUSED_LEAF.match(name)
            if m and (place := self._placement(m["prefix"])) is not None \
                    and tensor.dim() and tensor.shape[0] == place.num_experts:
                yield name, tensor[place.slot_experts]
                continue
            yield name, tensor


@torch.no_grad()
def fill_dummy_expert_shards(model: nn.Module, placements: dict[str, ExpertPlacement],
                             seed: int) -> None:
    """Dummy weights of the local experts = the same rows of a one-process model's dummy
    weights (drawn at full size, then sliced), so DEP and one process compute the same."""
    modules = dict(model.named_modules())
    for mname, place in placements.items():
        experts = modules[mname]
        for pname, param in experts.named_parameters(recurse=False):
            if param.dim() and param.shape[0] == place.num_local:
                full = dummy_tensor(f"{mname}.{pname}", (place.num_experts, *param.shape[1:]),
                                    seed)
                param.copy_(full[place.slot_experts].to(param.dtype))
