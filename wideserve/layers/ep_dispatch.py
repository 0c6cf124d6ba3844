"""Expert-parallel dispatch and combine (docs/distributed.md, "Expert parallelism").

Physical experts are numbered globally and split evenly over the EP ranks: physical expert p
lives on rank p // L as local slot p % L (L = that layer's experts per rank; MoE stacks with
different expert counts, a target and its draft, share one dispatcher whose count header is
as wide as the widest stack's L). `RoutedExperts.forward` maps
the router's logical ids to physical ones (its `logical_to_physical`, which EPLB rewrites) and,
with `experts.ep` set, hands the rows to a dispatcher:

    sort the (token, k) rows by physical expert -> they are grouped by destination rank, then
    by local slot; exchange a [world, L] count matrix first (plus a small header), then the
    rows with `all_to_all_single`; run them through the local experts (`grouped_mlp`); send the
    outputs back the same way and sum them, weighted, into their tokens (`combine`, as the
    single-process path does).

The counts tell the receiver the local slot of every row (rows arrive slot-sorted per source),
so no ids travel. The host reads the counts once per layer (all_to_all_single takes its splits
as lists); weights never leave the rank that routed the token.

Every MoE call is a collective, and ranks need not make the same number of calls in a step (a
rank that sampled nothing runs no draft forward). So every call's header carries "active" and
the layer's index, and `finish_step()` keeps a rank that has run out of calls answering its
peers' calls (running their rows through the experts of the layer each header names) until all
ranks say they are done. A peer may even be in a different layer: rows are computed with the
experts of the layer their source named.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from wideserve.parallel.groups import DPGroupError
from wideserve.layers.experts import combine

_ACTIVE, _LAYER, _HIDDEN, _DTYPE = 0, 1, 2, 3
_HEADER = 4
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class EPStats:
    calls: int = 0
    a2a_s: float = 0.0           # count + row exchanges (dispatch and combine)
    expert_s: float = 0.0        # grouped MLP over the rows this rank received
    rows_sent: int = 0
    rows_received: int = 0
    drain_calls: int = 0         # calls answered after this rank's own step was done


class EPDispatcher(ABC):
    """What `RoutedExperts.forward` calls under expert parallelism."""

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []
        self.stats = EPStats()

    def register(self, experts: nn.Module) -> int:
        """Give a layer its index (same module order on every rank) and point it here."""
        self.layers.append(experts)
        experts.ep = self
        experts.ep_layer = len(self.layers) - 1
        return experts.ep_layer

    @abstractmethod
    def forward(self, experts: nn.Module, x: torch.Tensor, phys_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, d], phys_ids / topk_weights [T, k] -> sum_k w * expert(x), [T, d]."""

    @abstractmethod
    def finish_step(self) -> None:
        """Answer peers' remaining MoE calls until every rank is done with the step."""

    def close(self) -> None:
        """The engine stopped: let go of the process group (it holds the rendezvous store
        and its port; engine/dp_engine.py, shutdown)."""


class AllToAllDispatcher(EPDispatcher):
    """Counts first, then rows, with `all_to_all_single` (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int,
                 num_local_experts: int, device: torch.device) -> None:
        super().__init__()
        self.group = group
        self.rank = rank
        self.world = world_size
        self.num_local = num_local_experts
        self.device = device
        local = torch.arange(num_local_experts, device=device)
        self._slot_pattern = local.repeat(world_size)         # [world * L]

    # --------------------------------------------------------------------- exchanges
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
             in_splits: list[int] | None = None) -> None:
        start = time.perf_counter()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DPGroupError(f"EP all-to-all failed: {e}") from e
        self.stats.a2a_s += time.perf_counter() - start

    def _exchange_meta(self, meta: torch.Tensor) -> torch.Tensor:
        """meta [world, H + L] int64, row r for rank r -> what each rank sent us."""
        recv = torch.empty_like(meta)
        self._a2a(recv, meta)
        return recv

    def _serve(self, recv_meta: torch.Tensor, recv_x: torch.Tensor) -> torch.Tensor:
        """Rows from each source through the experts of the layer that source named."""
        counts = recv_meta[:, _HEADER:]                        # [world, L]
        slots = torch.repeat_interleave(self._slot_pattern, counts.reshape(-1))
        if recv_x.shape[0] == 0:
            return recv_x
        start = time.perf_counter()
        layers = recv_meta[:, _LAYER].tolist()
        active = recv_meta[:, _ACTIVE].tolist()
        sizes = counts.sum(1).tolist()
        wanted = {layers[s] for s in range(self.world) if active[s] and sizes[s]}
        if len(wanted) == 1:
            out = self.layers[wanted.pop()].grouped_mlp(recv_x, slots)
        else:
            out = torch.empty_like(recv_x)
            lo = 0
            for s in range(self.world):
                hi = lo + sizes[s]
                if hi > lo:
                    out[lo:hi] = self.layers[layers[s]].grouped_mlp(recv_x[lo:hi], slots[lo:hi])
                lo = hi
        self.stats.expert_s += time.perf_counter() - start
        return out

    def _round(self, send_meta: torch.Tensor, send_x: torch.Tensor | None
               ) -> torch.Tensor | None:
        """One dispatch + combine. Returns the outputs of our rows (in send order), or None
        when no rank was active (the drain is over)."""
        recv_meta = self._exchange_meta(send_meta)
        active = recv_meta[:, _ACTIVE]
        if not bool(active.any()):
            return None
        shapes = {(int(h), int(t)) for a, h, t in
                  recv_meta[:, [_ACTIVE, _HIDDEN, _DTYPE]].tolist() if a}
        if len(shapes) != 1:
            raise RuntimeError(f"EP ranks disagree on the rows' (hidden size, dtype): {shapes}")
        hidden, dtype_code = shapes.pop()
        dtype = _DTYPES[dtype_code]
        if send_x is None:
            send_x = torch.empty(0, hidden, dtype=dtype, device=self.device)
        send_splits = send_meta[:, _HEADER:].sum(1).tolist()
        recv_splits = recv_meta[:, _HEADER:].sum(1).tolist()
        recv_x = send_x.new_empty(sum(recv_splits), hidden)
        self._a2a(recv_x, send_x, recv_splits, send_splits)
        y = self._serve(recv_meta, recv_x)
        back = send_x.new_empty(sum(send_splits), hidden)
        self._a2a(back, y.contiguous(), send_splits, recv_splits)
        self.stats.rows_sent += send_x.shape[0]
        self.stats.rows_received += recv_x.shape[0]
        return back

    def _meta(self, active: int, layer: int, hidden: int, dtype: torch.dtype,
              counts: torch.Tensor | None) -> torch.Tensor:
        meta = torch.zeros(self.world, _HEADER + self.num_local, dtype=torch.int64,
                           device=self.device)
        meta[:, _ACTIVE] = active
        meta[:, _LAYER] = layer
        meta[:, _HIDDEN] = hidden
        meta[:, _DTYPE] = _DTYPES.index(dtype)
        if counts is not None:
            meta[:, _HEADER:_HEADER + counts.shape[1]] = counts
        return meta

    # ----------------------------------------------------------------------- public
    def forward(self, experts: nn.Module, x: torch.Tensor, phys_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        k = phys_ids.shape[1]
        flat = phys_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # This layer's own experts per rank (a draft stack may hold fewer than the target's;
        # the header is as wide as the widest stack, the rest of the row stays zero).
        per_rank = experts.num_local_experts
        counts = torch.bincount(flat, minlength=self.world * per_rank)
        counts = counts.view(self.world, per_rank)
        token_of = order // k
        meta = self._meta(1, experts.ep_layer, x.shape[1], x.dtype, counts)
        back = self._round(meta, x.index_select(0, token_of))
        assert back is not None                                # we were active ourselves
        self.stats.calls += 1
        # Back to (token, k) order and the local path's own weighted sum: bitwise the same.
        y = torch.empty_like(back).index_copy_(0, order, back).view(*phys_ids.shape, x.shape[1])
        return combine(y, topk_weights).to(x.dtype)

    def finish_step(self) -> None:
        meta = self._meta(0, 0, 0, torch.float32, None)
        while self._round(meta, None) is not None:
            self.stats.drain_calls += 1

    def close(self) -> None:
        self.group = None


# Dispatcher name (ParallelConfig.ep_dispatcher) -> implementation. Every implementation takes
# (group, rank, world_size, num_local_experts, device).
EP_DISPATCHERS: dict[str, type[EPDispatcher]] = {"all_to_all": AllToAllDispatcher}


def register_dispatcher(name: str, cls: type[EPDispatcher]) -> None:
    """Add an EP dispatcher implementation under `name`."""
    if name in EP_DISPATCHERS:
        raise ValueError(f"EP dispatcher {name!r} is already registered")
    EP_DISPATCHERS[name] = cls


def make_dispatcher(name: str, group: dist.ProcessGroup, rank: int, world_size: int,
                    num_local_experts: int, device: torch.device) -> EPDispatcher:
    cls = EP_DISPATCHERS.get(name)
    if cls is None:
        raise ValueError(f"unknown EP dispatcher {name!r}; registered: "
                         f"{', '.join(sorted(EP_DISPATCHERS))}")
    return cls(group, rank, world_size, num_local_experts, device)
