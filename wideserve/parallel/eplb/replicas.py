"""Device-side logical -> physical maps with several replicas per logical expert.

`ReplicaTable` holds, for every MoE layer of one model, `table [L, E, W]` (slot ids of each
logical expert's replicas, ascending, padded with -1; W = 1 + redundant slots, fixed so the
tensors never change shape or address) and `count [L, E]`. Each layer's RoutedExperts holds
views of its rows; a rebalance rewrites rows in place.

`map_to_physical` spreads an expert's routings over its replicas round-robin by token: the
token at row t of a call goes to replica (t + offset) % count, and the layer's device-side
`offset` then advances by the call's row count, so even one decode row per step cycles
through the replicas, and ranks start at different offsets (their EP rank). Deterministic,
no randomness, no host sync. (By token, not by (token, k) position: with k even, position
parity would pin an expert that sits in the same top-k column to one replica.) Replicas hold
identical weights, so which one a token meets does not change its output. The load counters
count with `count_rows`: fixed shapes, no sync, as capture needs (docs/cuda_graphs.md).
"""
from __future__ import annotations

import torch

from wideserve.parallel.eplb.policy import logical_to_physical, replica_counts


def map_to_physical(topk_ids: torch.Tensor, table: torch.Tensor, count: torch.Tensor,
                    offset: torch.Tensor | None = None) -> torch.Tensor:
    """topk_ids [T, k] logical -> [T, k] physical slots; table [E, W], count [E], offset a
    0-d int64 device tensor advanced in place by T (None: start at 0, advance nothing)."""
    if table.shape[1] == 1:
        return table[topk_ids, 0]
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
    if offset is not None:
        rows = rows + offset
        offset.add_(topk_ids.shape[0])
    return table[topk_ids, rows % count[topk_ids]]


def count_rows(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[N] int64 slot ids in [0, num_slots) -> [num_slots] int64 rows per slot. A scatter into
    a fixed-size tensor: torch.bincount sizes its output from the data (a host sync on CUDA,
    which a CUDA graph cannot record)."""
    counts = torch.zeros(num_slots, dtype=torch.int64, device=slots.device)
    return counts.index_add_(0, slots, torch.ones_like(slots))


class ReplicaTable:
    def __init__(self, phy2log: torch.Tensor, num_logical: int, max_replicas: int,
                 device: torch.device, rank: int = 0) -> None:
        layers = phy2log.shape[0]
        self.num_logical = num_logical
        self.table = torch.full((layers, num_logical, max_replicas), -1, dtype=torch.int64,
                                device=device)
        self.count = torch.ones(layers, num_logical, dtype=torch.int64, device=device)
        self.offset = torch.full((layers,), rank, dtype=torch.int64, device=device)
        self.update(list(range(layers)), phy2log)

    def update(self, layers: list[int], phy2log: torch.Tensor) -> None:
        """Rewrite the maps of `layers` from their placement rows (phy2log [L, P], all
        layers; only the listed rows are read)."""
        rows = phy2log[layers]
        l2p = logical_to_physical(rows, self.num_logical)
        width = self.table.shape[2]
        if l2p.shape[2] > width:
            raise ValueError(f"an expert has {l2p.shape[2]} replicas; the table holds {width}")
        full = torch.full((len(layers), self.num_logical, width), -1, dtype=torch.int64)
        full[:, :, :l2p.shape[2]] = l2p
        idx = torch.tensor(layers, dtype=torch.int64)
        self.table[idx] = full.to(self.table.device)
        self.count[idx] = replica_counts(rows, self.num_logical).to(self.count.device)

    def bind(self, layers: list) -> None:
        """Give each layer views of its rows: layer.logical_to_physical [E, W],
        layer.replica_count [E] and layer.replica_offset (0-d)."""
        for i, layer in enumerate(layers):
            layer.logical_to_physical = self.table[i]
            layer.replica_count = self.count[i]
            layer.replica_offset = self.offset[i]
