"""Rebalancing policy: how many replicas each logical expert gets and which rank holds them.

Glossary (docs/eplb.md has the whole design):
- logical expert e in [0, E): what the router picks; physical slot p in [0, P), P = E + the
  redundant experts; slot p lives on rank p // S, S = P / R slots per rank (R ranks).
- placement `phy2log` [L, P]: the logical expert held by each slot, per MoE layer. Every
  logical expert has at least one slot; the others are replicas of the heaviest ones.
- load [L, E]: tokens routed to each logical expert over the window. A replica receives
  load / replica_count, because the router spreads an expert's tokens evenly over its
  replicas (`replicas.py`).
- balancedness of a layer: mean / max of the per-rank load (1.0 = perfectly even).

The algorithm (the shape of deepseek-ai/EPLB's, written here from its description):
1. Hierarchical only: pack expert *groups* onto nodes (G/N groups each) by group load, so
   group-limited routing stays inside a node.
2. Per node: give each redundant slot, one at a time, to the expert whose per-replica load is
   highest (greedy min-max of the per-replica load).
3. Pack the node's replicas onto its ranks, S each: heaviest first onto the lightest rank
   with room (cardinality-constrained LPT), then improve by pairwise swaps between the
   heaviest rank and any other while that lowers the heaviest rank's load. The swap pass is
   what we add: greedy LPT under an exact-cardinality constraint can leave a rank well above
   the optimum when a few replicas dominate (benchmarks/eplb/README.md compares both).
The global policy is the same with one group and one node. All of it runs on the host in
numpy: it runs once per rebalance, never in the decode loop.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Policy = Literal["auto", "global", "hierarchical"]


def replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """load [L, E] -> replica counts [L, E] (>= 1 each, rows sum to num_slots)."""
    layers, experts = load.shape
    if num_slots < experts:
        raise ValueError(f"{num_slots} physical slots cannot hold {experts} logical experts")
    counts = np.ones((layers, experts), dtype=np.int64)
    rows = np.arange(layers)
    for _ in range(num_slots - experts):
        counts[rows, np.argmax(load / counts, axis=1)] += 1
    return counts


def pack(weights: np.ndarray, num_packs: int, max_swaps: int | None = None) -> np.ndarray:
    """weights [n] (n % num_packs == 0) -> pack index [n]; every pack gets n / num_packs."""
    n = weights.shape[0]
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly over {num_packs} packs")
    per_pack = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_packs)
    sizes = np.zeros(num_packs, dtype=np.int64)
    for i in np.argsort(-weights, kind="stable"):
        # Lightest pack with room; full packs are masked out with +inf.
        k = int(np.argmin(np.where(sizes < per_pack, loads, np.inf)))
        pack_of[i] = k
        loads[k] += weights[i]
        sizes[k] += 1
    return _swap_down(weights, pack_of, loads, 4 * n if max_swaps is None else max_swaps)


def _swap_down(w: np.ndarray, pack_of: np.ndarray, loads: np.ndarray,
               max_swaps: int) -> np.ndarray:
    """Best-improvement pairwise swaps out of the heaviest pack. Each swap strictly lowers
    the heaviest pack and leaves the other below its old load, so the sorted load vector
    falls lexicographically and the loop ends; max_swaps bounds it anyway."""
    eps = 1e-9 * max(float(w.sum()), 1.0)
    for _ in range(max_swaps):
        h = int(np.argmax(loads))
        mine = np.nonzero(pack_of == h)[0]
        other = np.nonzero(pack_of != h)[0]
        if other.size == 0:
            break
        delta = w[mine][:, None] - w[other][None, :]            # [|mine|, |other|]
        worst = np.maximum(loads[h] - delta, loads[pack_of[other]][None, :] + delta)
        worst[delta <= eps] = np.inf
        flat = int(np.argmin(worst))
        i, j = divmod(flat, other.size)
        if not worst[i, j] < loads[h] - eps:
            break
        a, b = mine[i], other[j]
        q = pack_of[b]
        loads[h] -= delta[i, j]
        loads[q] += delta[i, j]
        pack_of[a], pack_of[b] = q, h
    return pack_of


def _place_node(load: np.ndarray, experts: np.ndarray, num_slots: int,
                num_ranks: int) -> np.ndarray:
    """One layer, one node: its experts' load [E] -> phy2log of its slots [num_slots],
    grouped by rank (rank-local order: heaviest replica first)."""
    sub = load[experts][None, :]
    counts = replicate(sub, num_slots)[0]
    items = np.repeat(np.arange(experts.size), counts)         # one per replica
    weights = (sub[0] / counts)[items]
    rank_of = pack(weights, num_ranks)
    order = np.lexsort((-weights, rank_of))                     # by rank, heaviest first
    return experts[items[order]]


def choose_policy(policy: Policy, num_groups: int, num_nodes: int) -> str:
    if policy == "auto":
        return "hierarchical" if num_nodes > 1 and num_groups % num_nodes == 0 else "global"
    return policy


def rebalance(load: torch.Tensor | np.ndarray, num_slots: int, num_ranks: int,
              num_nodes: int = 1, num_groups: int = 1, policy: Policy = "auto"
              ) -> torch.Tensor:
    """load [L, E] -> phy2log [L, num_slots] int64; slots s*S .. (s+1)*S-1 are rank s's."""
    w = np.asarray(load.cpu() if isinstance(load, torch.Tensor) else load, dtype=np.float64)
    layers, experts = w.shape
    kind = choose_policy(policy, num_groups, num_nodes)
    if kind == "global":
        num_groups, num_nodes = 1, 1
    _check_shape(experts, num_slots, num_ranks, num_nodes, num_groups, kind)
    per_group = experts // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_node, ranks_per_node = num_slots // num_nodes, num_ranks // num_nodes
    out = np.empty((layers, num_slots), dtype=np.int64)
    for layer in range(layers):
        group_load = w[layer].reshape(num_groups, per_group).sum(axis=1)
        node_of_group = (pack(group_load, num_nodes) if num_nodes > 1
                         else np.zeros(num_groups, dtype=np.int64))
        for node in range(num_nodes):
            groups = np.nonzero(node_of_group == node)[0]
            assert groups.size == groups_per_node
            experts_here = (groups[:, None] * per_group + np.arange(per_group)).reshape(-1)
            lo = node * slots_per_node
            out[layer, lo:lo + slots_per_node] = _place_node(
                w[layer], experts_here, slots_per_node, ranks_per_node)
    return torch.from_numpy(out)


def _check_shape(experts: int, num_slots: int, num_ranks: int, num_nodes: int,
                 num_groups: int, kind: str) -> None:
    if kind not in ("global", "hierarchical"):
        raise ValueError(f"EPLB policy must be auto, global or hierarchical, got {kind!r}")
    if num_slots % num_ranks:
        raise ValueError(f"{num_slots} physical experts do not split evenly over {num_ranks} "
                         f"expert-parallel ranks (num_redundant_experts must make "
                         f"experts + redundant a multiple of the EP size)")
    if num_slots < experts:
        raise ValueError(f"{num_slots} physical slots cannot hold {experts} experts")
    if experts % num_groups or num_groups % num_nodes or num_ranks % num_nodes:
        raise ValueError(f"hierarchical EPLB needs experts ({experts}) divisible by groups "
                         f"({num_groups}), groups by nodes ({num_nodes}) and ranks "
                         f"({num_ranks}) by nodes; use the global policy")
    if (num_slots // num_nodes) < experts // num_nodes:
        raise ValueError("fewer slots per node than experts per node")


# ------------------------------------------------------------------------- placement maps
def identity_placement(num_layers: int, num_logical: int, num_slots: int) -> torch.Tensor:
    """The placement before any rebalance: slot p holds expert p % E (contiguous experts,
    the redundant slots wrap around to the first experts)."""
    row = torch.arange(num_slots, dtype=torch.int64) % num_logical
    return row.expand(num_layers, num_slots).contiguous()


def replica_counts(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[L, P] -> [L, E] replicas per logical expert."""
    counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    return counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def logical_to_physical(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[L, P] -> [L, E, max_replicas] slot ids, ascending, padded with -1."""
    counts = replica_counts(phy2log, num_logical)
    width = int(counts.max())
    layers, slots = phy2log.shape
    out = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    order = torch.argsort(phy2log * slots + torch.arange(slots), dim=1)   # by expert, slot
    sorted_e = torch.gather(phy2log, 1, order)
    first = torch.cumsum(counts, 1) - counts                               # [L, E]
    rank_in_expert = torch.arange(slots) - torch.gather(first, 1, sorted_e)
    rows = torch.arange(layers)[:, None].expand(-1, slots)
    out[rows, sorted_e, rank_in_expert] = order
    return out


def align_to_current(new: torch.Tensor, current: torch.Tensor, num_ranks: int
                     ) -> torch.Tensor:
    """Reorder each rank's slots in `new` so an expert the rank already holds stays in its
    slot: the same per-rank contents (so the same balance), fewer weights to move."""
    layers, slots = new.shape
    per_rank = slots // num_ranks
    out = new.clone()
    for layer in range(layers):
        for r in range(num_ranks):
            lo, hi = r * per_rank, (r + 1) * per_rank
            want = new[layer, lo:hi].tolist()
            have = current[layer, lo:hi].tolist()
            row: list[int | None] = [None] * per_rank
            for i, e in enumerate(have):
                if e in want:
                    want.remove(e)
                    row[i] = e
            rest = iter(want)
            out[layer, lo:hi] = torch.tensor([e if e is not None else next(rest) for e in row])
    return out


# ------------------------------------------------------------------------------- metrics
def rank_loads(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Logical load [L, E] under a placement [L, P] -> expected per-rank load [L, R]
    (each replica gets an even share of its expert's load)."""
    load = torch.as_tensor(load, dtype=torch.float64)
    counts = replica_counts(phy2log, load.shape[1]).double()
    per_slot = torch.gather(load / counts.clamp(min=1), 1, phy2log)      # [L, P]
    return per_slot.reshape(phy2log.shape[0], num_ranks, -1).sum(-1)


def layer_balancedness(per_rank: torch.Tensor) -> torch.Tensor:
    """[L, R] -> [L] mean / max per layer (NaN for a layer with no load)."""
    per_rank = per_rank.double()
    peak = per_rank.max(dim=1).values
    return torch.where(peak > 0, per_rank.mean(dim=1) / peak.clamp(min=1e-30),
                       torch.full_like(peak, float("nan")))


def balancedness(per_rank: torch.Tensor) -> float:
    """[L, R] -> the mean over layers of each layer's mean/max rank load (the issue's and
    DESIGN's definition; vLLM's logger divides the sums over layers instead). Layers that saw
    no tokens are left out; with none at all, 1.0."""
    value = layer_balancedness(per_rank).nanmean() if per_rank.numel() else torch.tensor(1.0)
    return 1.0 if torch.isnan(value) else float(value)
