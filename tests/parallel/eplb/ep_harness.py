"""A minimal expert-parallel MoE for EPLB tests of their own (independent of the DEP
dispatcher): every rank all-gathers the step's rows, runs the ones routed to its local slots,
and an all-reduce sums the partial outputs. Slow and simple on purpose: it checks that the
replica maps, the weights in the slots and the moves between ranks agree."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wideserve.parallel.eplb.replicas import map_to_physical
from wideserve.layers.experts import swiglu

# The DEP tests' helpers (tests/parallel/dist_utils.py) are one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import free_port, free_port_block, run_ranks  # noqa: E402

__all__ = ["ep_moe", "reference_moe", "gloo_ranks", "free_port_block"]


def ep_moe(layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
           rank: int, world: int, num_slots: int,
           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x [T, d] (this rank's rows), logical topk_ids [T, k] -> [T, d] through the EP group."""
    phys = map_to_physical(topk_ids, layer.logical_to_physical, layer.replica_count,
                           layer.replica_offset)
    layer.expert_load += torch.bincount(phys.reshape(-1), minlength=num_slots)
    xs = [torch.empty_like(x) for _ in range(world)]
    ps = [torch.empty_like(phys) for _ in range(world)]
    ws = [torch.empty_like(topk_w) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(ps, phys, group=group)
    dist.all_gather(ws, topk_w, group=group)
    xa, pa, wa = torch.cat(xs), torch.cat(ps), torch.cat(ws)
    per_rank = num_slots // world
    out = torch.zeros_like(xa)
    for local in range(per_rank):
        rows, cols = torch.nonzero(pa == rank * per_rank + local, as_tuple=True)
        if rows.numel() and getattr(layer, "weight_format", None) is not None:
            # checkpoint-format experts (codes + scales): through the layer's own grouped MLP
            y = layer.grouped_mlp(xa[rows], torch.full_like(rows, local))
            out.index_add_(0, rows, y * wa[rows, cols, None])
        elif rows.numel():
            gate, up = F.linear(xa[rows], layer.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, None), layer.down_proj[local])
            out.index_add_(0, rows, y * wa[rows, cols, None])
    dist.all_reduce(out, group=group)
    return out[rank * x.shape[0]:(rank + 1) * x.shape[0]]


def reference_moe(ckpt: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                  topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """One process, logical experts straight from the checkpoint tensors."""
    w1, w2 = ckpt
    out = torch.zeros_like(x)
    for j in range(topk_ids.shape[1]):
        gate, up = torch.einsum("td,tod->to", x, w1[topk_ids[:, j]]).chunk(2, dim=-1)
        y = torch.einsum("ti,tdi->td", swiglu(gate, up, None), w2[topk_ids[:, j]])
        out += y * topk_w[:, j, None]
    return out


def gloo_ranks(fn: Callable[[int, int], None], world: int, timeout_s: float = 120) -> None:
    """fn(rank, world) in `world` spawned processes joined in one gloo group (dist_utils'
    run_ranks: bounded waits, every process gone when this returns)."""
    run_ranks(_in_group, world, (world, free_port(), fn), timeout_s)


def _in_group(rank: int, world: int, port: int, fn: Callable[[int, int], None]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()
