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
as lists); weights never leave the rank that routed the token. This exact path is what steps
with drafts and steps larger than the padded capacity take (prefill).

The padded path (docs/host_path.md, "Expert parallelism without host reads") reads nothing
from the device and makes no host collective inside the forward, so a CUDA graph can record
it (docs/cuda_graphs.md). Before a step's forward the runner exchanges the step header
(`begin_step`: how many tokens each rank's forward routes, host integers over the gloo
control group, no device value). When no rank routes more than the largest padded size, the
step's calls exchange fixed-capacity buffers instead, as DeepEP's low-latency mode does: to
each rank C = B * min(k, L) rows (B = the smallest padded size, `PaddedSteps.sizes`, that
holds every rank's tokens: the decode capture sizes, so a captured graph of size B replays
with the exchange it recorded), each with its local slot id, or L for a padding row. k, the
rows' width and dtype are the model's (`PaddedSteps`), fixed for the run. Row positions come
from a scatter count and a cumsum on the device; the receiver sorts its rows by slot (padding
last) and runs the grouped MLP, which skips the padding; the outputs return the same way.
Every rank then makes one call per registered layer, in order (the forward of a step without
drafts), so no header travels with the rows and nothing is left to drain; `finish_step`
makes the rounds a failed forward did not. A captured graph is recorded at a fixed size on
every rank at once (`fixed_step`, no header), and a replay, which runs no Python, is reported
by `forward_done`. Each expert gets the rows of the exact path, in the same order (outputs
equal up to GEMM rounding: a CPU grouped GEMM's blocking follows the total row count, padding
included).

Every MoE call is a collective, and ranks need not make the same number of calls in a step (a
rank that sampled nothing runs no draft forward). So every call's header carries "active" and
the layer's index, and `finish_step()` keeps a rank that has run out of calls answering its
peers' calls (running their rows through the experts of the layer each header names) until all
ranks say they are done. A peer may even be in a different layer: rows are computed with the
experts of the layer their source named.
"""
from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from wideserve.parallel.eplb.replicas import count_rows
from wideserve.parallel.groups import DPGroupError
from wideserve.layers.experts import combine

_ACTIVE, _LAYER, _HIDDEN, _DTYPE = 0, 1, 2, 3
_HEADER = 4
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass(frozen=True)
class PaddedSteps:
    """The padded path's shape (module docstring): `sizes` the tokens per rank a padded step
    may be padded to, ascending (the decode capture sizes: a step of at most sizes[-1] tokens
    on every rank goes padded), and the rows every MoE call routes: top-k, width, dtype."""

    sizes: tuple[int, ...]
    top_k: int
    hidden: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"PaddedSteps.sizes must be ascending positive sizes: {self.sizes}")


def _clock() -> float:
    """The host clock for the stats; 0 while torch.compile traces (a compiled or captured
    forward runs no Python per replay, and dynamo cannot trace the clock)."""
    return 0.0 if torch.compiler.is_compiling() else time.perf_counter()


@dataclass
class EPStats:
    calls: int = 0
    a2a_s: float = 0.0           # count + row exchanges (dispatch and combine)
    expert_s: float = 0.0        # grouped MLP over the rows this rank received
    rows_sent: int = 0
    rows_received: int = 0
    drain_calls: int = 0         # calls answered after this rank's own step was done
    padded_calls: int = 0        # calls over fixed-capacity buffers (no host read)
    padded_steps: int = 0        # steps whose header chose the padded path


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

    # The step header out of the forward (worker/decode_capture.py's StepSync): a dispatcher
    # without a padded path exchanges nothing before the forward and is not capturable.
    @property
    def capturable(self) -> bool:
        """Whether a decode forward's MoE calls make no host read and no host collective (a
        CUDA graph can record them), given the runner calls `begin_step` first."""
        return False

    def begin_step(self, tokens: int) -> int:
        """Before the forward: agree with the peers on the step; `tokens` this rank's forward
        routes. Returns the size every rank's forward is padded to (0: not padded)."""
        return 0

    @contextmanager
    def fixed_step(self, size: int) -> Iterator[None]:
        """A forward of `size` tokens run on every rank at once without a header (capture)."""
        yield

    def forward_done(self) -> None:
        """The step's forward ran to its end (a CUDA graph replay runs no Python)."""

    def close(self) -> None:
        """The engine stopped: let go of the process group (it holds the rendezvous store
        and its port; engine/dp_engine.py, shutdown)."""


class AllToAllDispatcher(EPDispatcher):
    """Counts first, then rows, with `all_to_all_single` (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int,
                 num_local_experts: int, device: torch.device,
                 control_group: dist.ProcessGroup | None = None,
                 padded: PaddedSteps | None = None) -> None:
        """control_group: a host (gloo) group over the same ranks for the step header;
        padded: the padded path's sizes and rows (None, or no control group: every call
        takes the exact path). It must be None where a step's ranks may make different MoE
        calls (drafts)."""
        super().__init__()
        self.group = group
        self.rank = rank
        self.world = world_size
        self.num_local = num_local_experts
        self.device = device
        self.control_group = control_group
        self.padded = padded if control_group is not None else None
        local = torch.arange(num_local_experts, device=device)
        self._slot_pattern = local.repeat(world_size)         # [world * L]
        # Host memory: the most tokens a rank's forward routes this step, over the ranks.
        self._header = np.zeros(1, dtype=np.int64)
        self._header_t = torch.from_numpy(self._header)
        self._step_open = False     # this step's header was exchanged (or it needs none)
        self._padded_tokens = 0     # B of this step's padded calls (0: the exact path)
        self._next_layer = 0        # the layer the next padded call must be

    # --------------------------------------------------------------------- exchanges
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
             in_splits: list[int] | None = None) -> None:
        start = _clock()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DPGroupError(f"EP all-to-all failed: {e}") from e
        self.stats.a2a_s += _clock() - start

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
        if not self._step_open:
            if self.padded is not None:
                # The peers may be in the header's collective, and a graph cannot hold one.
                raise RuntimeError("EP dispatch: the step header must be exchanged before "
                                   "the forward (begin_step; worker/model_runner.py)")
            self._step_open = True
        if self._padded_tokens:
            return self._padded_forward(experts, x, phys_ids, topk_weights)
        k = phys_ids.shape[1]
        flat = phys_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # This layer's own experts per rank (a draft stack may hold fewer than the target's;
        # the header is as wide as the widest stack, the rest of the row stays zero).
        per_rank = experts.num_local_experts
        counts = count_rows(flat, self.world * per_rank).view(self.world, per_rank)
        token_of = order // k
        meta = self._meta(1, experts.ep_layer, x.shape[1], x.dtype, counts)
        back = self._round(meta, x.index_select(0, token_of))
        assert back is not None                                # we were active ourselves
        self.stats.calls += 1
        # Back to (token, k) order and the local path's own weighted sum: bitwise the same.
        y = torch.empty_like(back).index_copy_(0, order, back).view(*phys_ids.shape, x.shape[1])
        return combine(y, topk_weights).to(x.dtype)

    def finish_step(self) -> None:
        if not self._step_open:
            self.begin_step(0)                     # no forward on this rank this step
        if self._padded_tokens:
            # Rounds a forward that failed part-way did not make (peers are in them). Every
            # rank made the same calls, so there is nothing to drain.
            while self._next_layer < len(self.layers):
                self._padded_round(self.layers[self._next_layer], None, 0, 0)
        else:
            meta = self._meta(0, 0, 0, torch.float32, None)
            while self._round(meta, None) is not None:
                self.stats.drain_calls += 1
        self._step_open = False
        self._padded_tokens = 0

    # ------------------------------------------------------------------- padded path
    @property
    def capturable(self) -> bool:
        return self.padded is not None

    def begin_step(self, tokens: int) -> int:
        """The step header: every rank's token count (0: no forward) over the host group;
        the padded path at the smallest padded size holding them all when there is one (a
        rank without a forward then takes part in every round with nothing to send). Host
        integers only: no device value is read. Returns B, or 0 for the exact path."""
        if self._step_open:
            raise RuntimeError("EP dispatch: begin_step twice in one step (finish_step ends one)")
        self._step_open, self._next_layer, self._padded_tokens = True, 0, 0
        if self.padded is None:
            return 0
        self._header[0] = tokens
        try:
            dist.all_reduce(self._header_t, op=dist.ReduceOp.MAX, group=self.control_group)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DPGroupError(f"EP step header failed: {e}") from e
        most, sizes = int(self._header[0]), self.padded.sizes
        if 0 < most <= sizes[-1]:
            self._padded_tokens = sizes[bisect.bisect_left(sizes, most)]
            self.stats.padded_steps += 1
        return self._padded_tokens

    @contextmanager
    def fixed_step(self, size: int) -> Iterator[None]:
        """Every rank runs a forward of `size` tokens now (capture at startup, in the same
        order everywhere): the padded path at B = size, with no header."""
        if self.padded is None or self._step_open:
            raise RuntimeError("EP dispatch: fixed_step needs the padded path, between steps")
        self._step_open, self._next_layer, self._padded_tokens = True, 0, size
        try:
            yield
        finally:
            self._step_open, self._padded_tokens = False, 0

    def forward_done(self) -> None:
        if self._padded_tokens:
            self._next_layer = len(self.layers)

    def _padded_forward(self, experts: nn.Module, x: torch.Tensor, phys_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
        if experts.ep_layer != self._next_layer:
            due = (f"layer {self._next_layer} was due" if self._next_layer < len(self.layers)
                   else "every layer was called already")
            raise RuntimeError(f"EP padded step: MoE layer {experts.ep_layer} called where "
                               f"{due} (a padded step's forward calls every registered layer "
                               f"once, in order; steps with drafts must not use it)")
        T, k = phys_ids.shape
        spec = self.padded
        assert spec is not None
        if (x.shape[1], x.dtype) != (spec.hidden, spec.dtype):
            raise RuntimeError(f"EP padded step: rows of ({x.shape[1]}, {x.dtype}) where the "
                               f"padded path expects ({spec.hidden}, {spec.dtype})")
        if T > self._padded_tokens or k > spec.top_k:
            raise RuntimeError(f"EP padded step: {T} tokens x top-{k} in a layer, the step "
                               f"header announced at most {self._padded_tokens} x "
                               f"top-{spec.top_k}")
        flat = phys_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)           # by destination rank, then slot
        L = experts.num_local_experts         # this layer's stack (a draft may hold fewer)
        counts = count_rows(flat, self.world * L).view(self.world, L)
        per_rank = counts.sum(1)
        first = torch.cumsum(per_rank, 0) - per_rank        # each destination's first row
        dest = flat.index_select(0, order) // L
        cap = self._capacity(L)
        # Sorted row i goes to slot (dest, i - first[dest]) of the padded send buffer.
        pos = dest * cap + torch.arange(T * k, device=x.device) - first.index_select(0, dest)
        slots = flat.index_select(0, order) % L
        back = self._padded_round(experts, x.index_select(0, order // k), pos, slots)
        self.stats.calls += 1
        self.stats.rows_sent += T * k
        y = torch.empty_like(back).index_copy_(0, order, back).view(*phys_ids.shape, x.shape[1])
        return combine(y, topk_weights).to(x.dtype)

    def _capacity(self, per_rank: int) -> int:
        """Rows per destination rank for a layer of `per_rank` experts per rank: a token sends
        at most min(k, per_rank) rows to one rank."""
        assert self.padded is not None
        return self._padded_tokens * min(self.padded.top_k, per_rank)

    def _padded_round(self, experts: nn.Module, rows: torch.Tensor | None,
                      pos: torch.Tensor | int, slots: torch.Tensor | int) -> torch.Tensor:
        """Send `rows` (sorted, [N, d]) to their positions `pos` of the padded buffers, with
        their local `slots`; serve what arrives with this layer's experts; return the N
        outputs. rows None: a round with nothing to send (finish_step)."""
        assert self.padded is not None
        hidden, dtype = self.padded.hidden, self.padded.dtype
        L = experts.num_local_experts
        n = self.world * self._capacity(L)
        send_x = torch.zeros(n, hidden, dtype=dtype, device=self.device)
        send_slot = torch.full((n,), L, dtype=torch.int64, device=self.device)
        if rows is not None:
            send_x.index_copy_(0, pos, rows)
            send_slot.index_copy_(0, pos, slots)
        recv_x, recv_slot = torch.empty_like(send_x), torch.empty_like(send_slot)
        self._a2a(recv_slot, send_slot)
        self._a2a(recv_x, send_x)
        start = _clock()
        y = experts.grouped_mlp(recv_x, recv_slot, padded=True)
        self.stats.expert_s += _clock() - start
        back = torch.empty_like(send_x)
        self._a2a(back, y)
        self.stats.padded_calls += 1
        self._next_layer += 1
        if rows is None:
            return back[:0]
        return back.index_select(0, pos)

    def close(self) -> None:
        self.group = self.control_group = None


# Dispatcher name (ParallelConfig.ep_dispatcher) -> implementation. Every implementation takes
# (group, rank, world_size, num_local_experts, device).
EP_DISPATCHERS: dict[str, type[EPDispatcher]] = {}


def register_dispatcher(name: str, cls: type[EPDispatcher]) -> None:
    """Add an EP dispatcher implementation under `name` (the built-in one too, below)."""
    if name in EP_DISPATCHERS:
        raise ValueError(f"EP dispatcher {name!r} is already registered")
    EP_DISPATCHERS[name] = cls


register_dispatcher("all_to_all", AllToAllDispatcher)


def make_dispatcher(name: str, group: dist.ProcessGroup, rank: int, world_size: int,
                    num_local_experts: int, device: torch.device, **options: Any
                    ) -> EPDispatcher:
    """options: implementation-specific keywords (AllToAllDispatcher: control_group,
    padded)."""
    cls = EP_DISPATCHERS.get(name)
    if cls is None:
        raise ValueError(f"unknown EP dispatcher {name!r}; registered: "
                         f"{', '.join(sorted(EP_DISPATCHERS))}")
    return cls(group, rank, world_size, num_local_experts, device, **options)
