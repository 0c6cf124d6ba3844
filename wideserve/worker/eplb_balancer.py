"""EPLB for one model's MoE layers (the target's, or the draft's): record, rebalance, move.

Lifecycle, driven by `step()` once per engine step on every EP rank (dummy steps included,
so the step counters, and with them the collectives, agree across ranks):
1. every step: fold the layers' on-device counts into the window (recorder.py);
2. every `step_interval` steps: all-reduce the windowed per-slot load over the EP group, turn
   it into per-logical-expert load, compute a placement on EP rank 0 (policy.py), keep the
   current placement of each layer the new one does not improve, align the rest to the
   current slots, broadcast;
3. on that step and the following ones, `layers_per_step` layers at a time: move their
   weights into spare buffers (transfer.py), copy them in, rewrite their replica maps and
   forget their load history. A layer's weights and map change on the same step on every
   rank, so a forward never sees a map that disagrees with the weights.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from wideserve.parallel.eplb import policy
from wideserve.config.eplb import EplbConfig
from wideserve.parallel.eplb.recorder import LoadRecorder
from wideserve.parallel.eplb.replicas import ReplicaTable
from wideserve.parallel.eplb.transfer import execute_layer, plan_layer

if TYPE_CHECKING:      # layers/experts.py imports this package
    from wideserve.layers.experts import RoutedExperts

logger = logging.getLogger(__name__)
# Balancedness refresh when log_balancedness is off (it feeds /metrics): one small
# all-reduce per this many steps under EP.
STATS_INTERVAL = 100


@dataclass(slots=True)
class EpGroup:
    """The expert-parallel group as EPLB needs it; group None = one process."""
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    num_nodes: int = 1


@dataclass(slots=True)
class BalancerStats:
    balancedness: float = 1.0          # mean over layers of mean/max rank load, last window
                                       # (1.0 until the first refresh)
    balancedness_steps: int = 0        # window steps behind that number
    rebalances: int = 0                # completed rebalances
    rebalancing: bool = False
    layers_moved: int = 0              # cumulative
    bytes_sent: int = 0                # cumulative, this rank
    last_rebalance_s: float = 0.0      # wall time from plan to last layer moved
    last_rebalance_steps: int = 0      # steps it spanned
    last_plan_s: float = 0.0           # reduce + policy + broadcast
    max_move_step_s: float = 0.0       # worst per-step cost of moving weights, last rebalance
    steps: int = 0                     # the step counter every EP rank shares


def expert_weights(layer: nn.Module) -> list[torch.Tensor]:
    """The per-slot weight tensors of a RoutedExperts-like layer: its own parameters, all
    [slots, ...], in name order (the order transfers use on every rank)."""
    return [p for _, p in sorted(layer.named_parameters(recurse=False))]


class ExpertBalancer:
    def __init__(self, name: str, layers: list[RoutedExperts], num_logical: int,
                 config: EplbConfig, ep: EpGroup, device: torch.device,
                 num_groups: int = 1) -> None:
        self.name, self.layers, self.config, self.ep = name, layers, config, ep
        self.num_logical, self.num_groups = num_logical, num_groups
        self.num_slots = num_logical + config.num_redundant_experts
        if self.num_slots % ep.size:
            raise ValueError(f"eplb_config.num_redundant_experts: {num_logical} experts + "
                             f"{config.num_redundant_experts} redundant = {self.num_slots} "
                             f"physical experts, not a multiple of the EP size {ep.size}")
        self.per_rank = self.num_slots // ep.size
        self.device = device
        num_layers = len(layers)
        self.placement = policy.identity_placement(num_layers, num_logical, self.num_slots)
        for i, layer in enumerate(layers):
            self._fit_slots(layer, self.placement[i])
        self.table = ReplicaTable(self.placement, num_logical,
                                  1 + config.num_redundant_experts, device, ep.rank)
        self.table.bind(layers)
        self.recorder = LoadRecorder(num_layers, self.num_slots, config.window_size, device)
        self.recorder.bind(layers)
        self.spares = [[torch.empty_like(w) for w in expert_weights(layers[0])]
                       for _ in range(min(config.layers_per_step, num_layers))]
        self.stats = BalancerStats()
        # [L, E] fingerprint of every logical expert's weights as loaded (verify_weights).
        self.fingerprints = self._loaded_fingerprints()
        self.steps = 0
        self._next: torch.Tensor | None = None
        self._pending: list[int] = []
        self._started = 0.0
        self._started_step = 0
        self._stat: torch.Tensor | None = None        # [2] on the device: value, steps

    # ------------------------------------------------------------------------ setup
    def _fit_slots(self, layer: nn.Module, row: torch.Tensor) -> None:
        """One process with redundant slots: the loader filled E rows; give each slot its
        expert's weights. Under EP the loader fills this rank's slots itself (`local_experts`)."""
        for w in expert_weights(layer):
            if w.shape[0] == self.per_rank:
                continue
            if w.shape[0] == self.num_logical and self.ep.size == 1:
                w.data = w.data[row.to(w.device)].contiguous()
                continue
            raise ValueError(f"EPLB {self.name}: expert weights have {w.shape[0]} rows, "
                             f"expected {self.per_rank} slots on this rank")
        layer.num_local_experts = self.per_rank

    def local_experts(self, layer: int = 0) -> list[int]:
        """The logical expert in each of this rank's slots (what a loader must put there)."""
        lo = self.ep.rank * self.per_rank
        return self.placement[layer, lo:lo + self.per_rank].tolist()

    def _slot_fingerprints(self, layer: nn.Module) -> torch.Tensor:
        """[S] float64: each local slot's weights dotted with a fixed ramp (any change of a
        value or of its position changes it)."""
        out = torch.zeros(self.per_rank, dtype=torch.float64, device=self.device)
        for w in expert_weights(layer):
            flat = w.detach().reshape(w.shape[0], -1).double()
            ramp = torch.linspace(1.0, 2.0, flat.shape[1], dtype=torch.float64,
                                  device=flat.device)
            out += (flat @ ramp).to(self.device)
        return out

    def _loaded_fingerprints(self) -> torch.Tensor:
        local = torch.stack([self._slot_fingerprints(m) for m in self.layers])   # [L, S]
        if self.ep.size > 1:
            parts = [torch.empty_like(local) for _ in range(self.ep.size)]
            dist.all_gather(parts, local, group=self.ep.group)
            local = torch.cat(parts, dim=1)                                    # [L, P]
        table = torch.empty(len(self.layers), self.num_logical, dtype=torch.float64)
        # Slot p holds expert p % E before any rebalance; the first E slots cover them all.
        table[:] = local[:, :self.num_logical].cpu()
        return table

    def verify_weights(self) -> None:
        """Every local slot holds the weights the loader put in for the logical expert the
        map says it holds (fingerprints taken at load time, gathered from every rank)."""
        lo = self.ep.rank * self.per_rank
        for i, layer in enumerate(self.layers):
            want = self.fingerprints[i, self.placement[i, lo:lo + self.per_rank]]
            got = self._slot_fingerprints(layer).cpu()
            if not torch.allclose(got, want, rtol=1e-9, atol=0.0):
                bad = torch.nonzero(~torch.isclose(got, want, rtol=1e-9, atol=0.0))[:, 0]
                raise RuntimeError(
                    f"EPLB {self.name}: layer {i} slots {(bad + lo).tolist()} do not hold "
                    f"the weights of experts {self.placement[i, lo + bad].tolist()}")

    # ------------------------------------------------------------------------- step
    def step(self, dummy: bool = False) -> None:
        self._read_balancedness()
        self.recorder.end_step(dummy)
        self.steps += 1
        self.stats.steps = self.steps
        if not self._pending and self.steps % self.config.step_interval == 0:
            self._plan()
        if self._pending:
            self._move_some()
        every = (self.config.log_balancedness_interval if self.config.log_balancedness
                 else STATS_INTERVAL)
        if self.steps % every == 0:
            self._refresh_balancedness()

    def _global_slot_load(self) -> torch.Tensor:
        load = self.recorder.window_sum.clone()
        if self.ep.size > 1:
            dist.all_reduce(load, group=self.ep.group)
        return load

    def _plan(self) -> None:
        t0 = time.perf_counter()
        slot_load = self._global_slot_load().cpu()
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=torch.int64)
        logical.scatter_add_(1, self.placement, slot_load)
        if self.ep.rank == 0:
            new = self._choose(logical)
        else:
            new = torch.empty_like(self.placement)
        if self.ep.size > 1:
            buf = new.to(self.device)
            dist.broadcast(buf, dist.get_global_rank(self.ep.group, 0)
                           if self.ep.group is not None else 0, group=self.ep.group)
            new = buf.cpu()
        self._next = new
        self._pending = [i for i in range(len(self.layers))
                         if not torch.equal(new[i], self.placement[i])]
        self.stats.last_plan_s = time.perf_counter() - t0
        self.stats.rebalancing = bool(self._pending)
        if self._pending:           # a plan that moves nothing keeps the last move's numbers
            self.stats.max_move_step_s = 0.0
        self._started, self._started_step = t0, self.steps
        logger.info("EPLB %s: rebalance planned at step %d in %.3f s; %d of %d layers move",
                    self.name, self.steps, self.stats.last_plan_s, len(self._pending),
                    len(self.layers))

    def _choose(self, logical: torch.Tensor) -> torch.Tensor:
        """Rank 0: the policy's placement, keeping each layer it does not improve."""
        cfg, ranks = self.config, self.ep.size
        new = policy.rebalance(logical, self.num_slots, ranks, self.ep.num_nodes,
                               self.num_groups, cfg.policy_name)  # type: ignore[arg-type]
        cur_peak = policy.rank_loads(logical, self.placement, ranks).max(dim=1).values
        new_peak = policy.rank_loads(logical, new, ranks).max(dim=1).values
        keep = ~(new_peak < cur_peak * (1 - 1e-6))
        new[keep] = self.placement[keep]
        return policy.align_to_current(new, self.placement, ranks)

    def _move_some(self) -> None:
        t0 = time.perf_counter()
        assert self._next is not None
        layers = self._pending[:len(self.spares)]
        del self._pending[:len(layers)]
        for spare, i in zip(self.spares, layers):
            plan = plan_layer(self.placement[i].tolist(), self._next[i].tolist(),
                              self.ep.rank, self.ep.size)
            self.stats.bytes_sent += execute_layer(plan, expert_weights(self.layers[i]),
                                                   spare, self.ep.group)
            for w, s in zip(expert_weights(self.layers[i]), spare):
                w.data.copy_(s)
            self.layers[i].weights_changed()     # packed copies (layers/experts.py)
        self.placement[layers] = self._next[layers]
        self.table.update(layers, self.placement)
        self.recorder.forget_layers(layers)
        self.stats.layers_moved += len(layers)
        took = time.perf_counter() - t0
        self.stats.max_move_step_s = max(self.stats.max_move_step_s, took)
        if not self._pending:
            self._finish()

    def _finish(self) -> None:
        s = self.stats
        s.rebalances += 1
        s.rebalancing = False
        s.last_rebalance_s = time.perf_counter() - self._started
        s.last_rebalance_steps = self.steps - self._started_step + 1
        self._next = None
        logger.info("EPLB %s: rebalance %d done in %.3f s over %d steps (worst step %.1f "
                    "ms moving weights, %d bytes sent by this rank so far)", self.name,
                    s.rebalances, s.last_rebalance_s, s.last_rebalance_steps,
                    1e3 * s.max_move_step_s, s.bytes_sent)

    # -------------------------------------------------------------------- metrics
    def _read_balancedness(self) -> None:
        """The value the previous step's refresh copied out: a whole step later, the engine's
        own host reads (the sampled tokens) have synchronised the device since."""
        if self._stat is None:
            return
        value, steps = self._stat.tolist()
        self._stat = None
        self.stats.balancedness, self.stats.balancedness_steps = value, int(steps)
        if self.config.log_balancedness:
            logger.info("EPLB %s: balancedness %.4f over the last %d steps", self.name,
                        value, int(steps))

    def _refresh_balancedness(self) -> None:
        """Computed on the device from the window and copied to the host without blocking;
        read at the next step (`_read_balancedness`), so the decode loop never waits for it."""
        per_rank = self._global_slot_load().reshape(len(self.layers), self.ep.size, -1).sum(-1)
        peak = per_rank.amax(1)
        ratio = per_rank.double().mean(1) / peak.clamp(min=1)
        busy = (peak > 0).double()
        # Mean over layers that saw tokens (as policy.balancedness); no layer busy -> 1.0.
        value = torch.where(busy.sum() > 0, (ratio * busy).sum() / busy.sum().clamp(min=1),
                            torch.ones((), dtype=torch.float64, device=peak.device))
        steps = torch.full((), float(min(self.recorder.steps, self.config.window_size)),
                           dtype=torch.float64, device=peak.device)
        self._stat = torch.stack([value, steps]).to("cpu", non_blocking=True)
