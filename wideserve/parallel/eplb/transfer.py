"""Moving one MoE layer's expert weights from an old placement to a new one.

Every rank computes the same global plan from (old, new) placement rows, so sends and
receives pair up without any negotiation:
- a rank that already holds expert e (in any of its slots) copies it locally;
- otherwise it receives e once (even for two slots) from one rank that holds it; among the
  holders the one with the fewest sends so far is chosen, so senders share the work;
- transfers go in ascending (expert, destination) order, every weight tensor of an expert in
  a fixed order, tagged with the expert id, through one `batch_isend_irecv`.
Everything lands in spare buffers first (the old weights are still being read as sources);
the caller copies the buffers into the live weights and swaps the layer's map together.
The copy (rather than swapping storage) keeps the parameters' addresses, so captured CUDA
graphs and any cached views stay valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(slots=True)
class LayerPlan:
    local: list[tuple[int, int]] = field(default_factory=list)     # (dst slot, src slot)
    recv: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (src, e, dsts)
    send: list[tuple[int, int, int]] = field(default_factory=list)  # (dst rank, e, src slot)

    @property
    def moves(self) -> int:
        return len(self.recv) + len(self.send)


def plan_layer(old: list[int], new: list[int], rank: int, num_ranks: int) -> LayerPlan:
    """old/new: one layer's phy2log rows (length P) -> this rank's part of the plan."""
    per_rank = len(old) // num_ranks
    held = [old[r * per_rank:(r + 1) * per_rank] for r in range(num_ranks)]
    wanted = [new[r * per_rank:(r + 1) * per_rank] for r in range(num_ranks)]
    sends_of = [0] * num_ranks
    plan = LayerPlan()
    for e, dst in sorted({(e, d) for d in range(num_ranks) for e in wanted[d]
                          if e not in held[d]}):
        src = min((r for r in range(num_ranks) if e in held[r]),
                  key=lambda r: (sends_of[r], r))
        sends_of[src] += 1
        if dst == rank:
            plan.recv.append((src, e, [i for i, x in enumerate(wanted[rank]) if x == e]))
        elif src == rank:
            plan.send.append((dst, e, held[rank].index(e)))
    for i, e in enumerate(wanted[rank]):
        if e in held[rank]:
            plan.local.append((i, held[rank].index(e)))
    return plan


def execute_layer(plan: LayerPlan, weights: list[torch.Tensor], spares: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> int:
    """Fill `spares` (same shapes as `weights`, [S, ...] each) with the new local layout;
    returns the bytes this rank sent. Blocks until the layer's transfers are done."""
    for dst, src in plan.local:
        for w, s in zip(weights, spares):
            s[dst].copy_(w[src])
    ops: list[dist.P2POp] = []
    for peer, e, dsts in plan.recv:
        ops += [dist.P2POp(dist.irecv, s[dsts[0]], _global(peer, group), group, tag=e)
                for s in spares]
    sent = 0
    for peer, e, src in plan.send:
        for w in weights:
            ops.append(dist.P2POp(dist.isend, w[src].contiguous(), _global(peer, group),
                                  group, tag=e))
            sent += w[src].numel() * w.element_size()
    if ops:
        ops.sort(key=lambda op: op.tag)        # the global (expert, ...) order on both ends
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for _, _, dsts in plan.recv:
        for s in spares:
            for d in dsts[1:]:
                s[d].copy_(s[dsts[0]])
    return sent


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    """A rank of `group` -> the global rank P2POp wants."""
    return rank if group is None else dist.get_global_rank(group, rank)
