"""The captured decode step: decode batches padded to capture sizes, over static buffers.

docs/host_path.md ("The captured decode step") describes the design; in short:
- A decode step (every request one new token: no prefill chunk, no drafts, no replay, no prompt
  logprobs) of R requests is padded to the smallest capture size >= R (`capture_sizes`: 1, 2,
  4, then multiples of 8 up to max_num_seqs, as vLLM pads). Larger or other steps run eagerly.
- Its metadata (token ids, positions, context lengths, query offsets, block-table rows, slots)
  is written into buffers allocated once for the largest size (`StaticDecodeInputs`): on CUDA
  a pinned host staging copy uploaded with non_blocking, on the CPU the device buffer itself.
  A step allocates no metadata tensor; the batch the model sees is views of these buffers.
- Padded rows are requests of one token (id 0) at position 0 whose block-table row is all null
  blocks (`BlockTables.reserve_row`): they write only the null block (block 0, never handed
  out, never read as data) and their outputs are dropped. The KV cache's other blocks and the
  block pool are untouched (tests/engine/test_decode_capture.py).
- One replay per capture size. On CUDA, for a model that declares its decode forward
  capturable (`decode_capturable(device)`, see `capturable`), the replay is a
  `torch.cuda.CUDAGraph` captured at startup after warm-up runs, one per size and context
  bucket (`context_buckets`: each reads the block tables narrowed to its bucket); everywhere
  else a replay is the eager forward run over the static buffers (`EagerReplay`).
  `--enforce-eager` (LoadConfig.enforce_eager) turns the captured step off. The CUDA capture
  is the only part the CPU cannot run; the CPU tests hold the forward to what it needs
  (worker/capture_guard.py: the capture guard and the torch.compile(fullgraph=True) check)
  and benchmarks/cuda_graph_check.py checks it on a GPU.

One staging copy suffices: a step rewrites it only after the previous step's sampled tokens
were read back (a host sync), so the previous upload has run.
"""
from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from wideserve.types.forward_batch import ForwardBatch, KVGroupView

if TYPE_CHECKING:
    from wideserve.worker.block_tables import BlockTables

logger = logging.getLogger(__name__)


class StepRequest(Protocol):
    """What a captured decode step reads of a request's share of the step (the runner's
    model_runner.StepRequest); a protocol so that this module, which the runner imports, need
    not import the runner."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: Sequence[Sequence[int]]
    kv_write_start: int
    prompt_logits: bool
    num_spec: int
    is_new: bool
    context: Sequence[int]


class DecodeStaging(Protocol):
    """A model's host-computed decode inputs (CausalLM.decode_staging): DeepSeek-V4.1's
    Engram rows, gathered from a host table by ids hashed on the host (layers/engram.py)."""

    def stage(self, tokens: Sequence[int], positions: Sequence[int],
              contexts: Sequence[Sequence[int]], n: int) -> None:
        """Rows [:len(tokens)] for the requests' new tokens at their positions after their
        contexts, rows up to n for the padding (token 0 at position 0), written into static
        device buffers (uploaded without blocking)."""

    def inputs(self, n: int) -> dict[str, torch.Tensor]:
        """The first n rows of those buffers, as the batch's extras."""


class StepSync(Protocol):
    """Peers whose forwards must agree on a step before it runs: under DEP the EP dispatcher
    (layers/ep_dispatch.py), whose MoE calls are collectives over fixed-capacity buffers. Its
    host collective runs here, before the forward, so the forward holds none and a graph can
    record it (docs/cuda_graphs.md)."""

    def begin_step(self, tokens: int) -> int:
        """Tell the peers how many tokens this rank's forward routes (host integers). Returns
        the size every rank's forward is padded to (0: none, the forward is not padded)."""

    def fixed_step(self, size: int) -> AbstractContextManager[None]:
        """A forward of `size` rows that every rank runs at once with no step header (the
        capture at startup: every rank captures the same sizes in the same order)."""

    def forward_done(self) -> None:
        """The forward ran to its end (a graph replay runs no Python to say so)."""


class GroupLayout(Protocol):
    """What a captured decode step reads of a KV group's layout (model_runner.GroupLayout)."""

    block_size: int
    compress_ratio: int

MAX_CAPTURE_SIZE = 512          # vLLM's default largest capture size
# Context buckets of the CUDA graphs: max_model_len, then / CONTEXT_BUCKET_FACTOR down to no
# less than MIN_CONTEXT_BUCKET positions (see `context_buckets`).
MIN_CONTEXT_BUCKET = 1024
CONTEXT_BUCKET_FACTOR = 4
_FIELDS = ("input_ids", "positions", "seq_lens", "req_rows")


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, max_size) (included)."""
    top = max(1, min(max_num_seqs, max_size))
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]
    return tuple(sorted(set(sizes)))


def context_buckets(max_model_len: int, smallest: int = MIN_CONTEXT_BUCKET,
                    factor: int = CONTEXT_BUCKET_FACTOR) -> tuple[int, ...]:
    """The longest contexts (positions) the graphs of one size are captured for, ascending:
    max_model_len, max_model_len / factor, ... while >= smallest. A graph reads its block
    tables narrowed to its bucket's width, and the static decode attention gathers every
    position of that width (docs/cuda_graphs.md): without buckets a short-context step would
    read max_model_len positions per request and layer."""
    out = [max_model_len]
    while -(-out[-1] // factor) >= smallest:
        out.append(-(-out[-1] // factor))
    return tuple(sorted(out))


# Whether the CPU pads decode steps over static buffers by default: measured not to pay on
# the 11M Qwen3-MoE (BENCHMARKS.md, "Captured decode step on the CPU"), so it does not.
CPU_DEFAULT = False


def decode_capture_enabled(enforce_eager: bool | None, decode_capture: bool | None,
                           device: torch.device, capturable: bool) -> bool:
    """LoadConfig.decode_capture, resolved. None: on CUDA where the model is capturable (a
    graph is really captured; an eager replay of a padded batch would only add rows), on the
    CPU as CPU_DEFAULT says. --enforce-eager (vLLM's meaning: every step eager) turns it off,
    and asking for both is an error. True/False force it (True on a model that cannot be
    captured: padded eager replays over the static buffers)."""
    if enforce_eager and decode_capture:
        raise ValueError("decode_capture=True contradicts enforce_eager=True (--enforce-eager "
                         "runs every step eagerly, without the captured decode step)")
    if decode_capture is not None:
        return decode_capture
    if enforce_eager:
        return False
    return capturable if device.type == "cuda" else CPU_DEFAULT


def padded_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= num_reqs; None when the batch is larger than all."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_step(reqs: Sequence[StepRequest]) -> bool:
    """A step the captured decode covers: every request one new token and nothing else."""
    return bool(reqs) and all(len(r.token_ids) == 1 and not r.num_spec and not r.prompt_logits
                              and not r.kv_write_start for r in reqs)


class StaticDecodeInputs:
    """The decode step's metadata for up to `size` rows, allocated once.

    `host[name]` is where a step writes (numpy); `dev[name]` what the model reads. On the CPU
    they are the same memory; on CUDA `host` is pinned and `upload` copies without blocking."""

    def __init__(self, size: int, slot_groups: Sequence[int], device: torch.device,
                 separate_copy: bool = False) -> None:
        """separate_copy: a device copy uploaded each step even on the CPU (what CUDA does;
        lets the CPU tests exercise that path)."""
        self.size, self.device = size, device
        self._same = device.type == "cpu" and not separate_copy
        names = [*_FIELDS, "query_start_loc", *(f"slots{g}" for g in slot_groups)]
        self._host_t: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name in names:
            n = size + 1 if name == "query_start_loc" else size
            pin = device.type == "cuda"
            self._host_t[name] = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
            self.dev[name] = self._host_t[name] if self._same else \
                torch.zeros(n, dtype=torch.int64, device=device)
        self.host = {k: t.numpy() for k, t in self._host_t.items()}
        self.host["query_start_loc"][:] = np.arange(size + 1)    # one token per row, always

    def upload(self, n: int) -> None:
        """Make rows [:n] of the device buffers equal the host's (a no-op on the CPU)."""
        if self._same:
            return
        for name, host in self._host_t.items():
            m = n + 1 if name == "query_start_loc" else n
            self.dev[name][:m].copy_(host[:m], non_blocking=True)


class Capturer(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Given the forward over one size's static buffers, the replay of it."""


class EagerReplay:
    """A replay that runs the forward again over the static buffers (the CPU's, and every
    model that cannot be captured): the same buffers, padding and outputs as a graph."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return run


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph per size, sharing one memory pool (captured largest first, so the
    smaller graphs fit in the largest one's pool). The replay returns the graph's static
    output, overwritten by the next replay: the runner reads it within the step.
    Not yet run on a GPU (no GPU was lent where it was written): benchmarks/cuda_graph_check.py
    is the check to run there (docs/cuda_graphs.md)."""

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        self.device, self.warmup = device, warmup
        self._pool = None

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        cuda = torch.cuda
        side = cuda.Stream(self.device)
        side.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(side):           # warm-up off the default stream, as capture wants
            for _ in range(self.warmup):
                run()
        cuda.current_stream(self.device).wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self._pool):
            out = run()
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


def capturable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a CUDA graph may record the model's decode forward: no host sync, no host-built
    per-step tensor, shapes fixed by the batch size (docs/cuda_graphs.md). Any family: the
    model says so with `CausalLM.decode_capturable(device)` (models/interface.py), and the
    capturer records whatever forward declares it. Today the Llama family (Llama, Qwen2,
    Qwen3, Qwen3-MoE without an EP dispatcher) does on CUDA; DeepSeek-V4/V4.1 declare it when
    their decode forwards meet the rules. CPU checks of the declaration: CaptureGuard /
    GuardedCapturer and FullgraphCapturer (worker/capture_guard.py)."""
    return bool(model.decode_capturable(device))


@dataclass(slots=True)
class DecodeStep:
    hidden: torch.Tensor          # [R, d] the real rows' outputs
    batch: ForwardBatch           # the real rows' batch (views of the static buffers)


class CapturedDecode:
    """One runner's captured decode: static buffers, the padding row, a replay per size."""

    def __init__(self, model: torch.nn.Module, groups: Sequence[GroupLayout],
                 cache_group: dict[str, int], kv_caches: dict[str, torch.Tensor],
                 tables: BlockTables, device: torch.device, sizes: Sequence[int],
                 capturer: Capturer | None = None, step_sync: StepSync | None = None) -> None:
        """capturer None: CUDA graphs where the device is CUDA and the model is capturable,
        else EagerReplay. step_sync: the peers a forward must agree with (DEP); the capture
        runs each size under its `fixed_step`, in the same order on every rank."""
        self.model, self.groups, self.cache_group = model, list(groups), cache_group
        self.kv_caches, self.tables, self.device = kv_caches, tables, device
        self.sizes = tuple(sorted(sizes))
        if capturer is None:
            graphs = device.type == "cuda" and capturable(model, device)
            if device.type == "cuda" and not graphs:
                logger.info("%s is not capturable: decode steps replay eagerly over the static "
                            "buffers", type(model).__name__)
            capturer = CudaGraphCapturer(device) if graphs else EagerReplay()
        self.capturer = capturer
        self.step_sync = step_sync
        self._capturing = False
        # Inputs the model computes on the host before a replay (None: it needs none).
        self.staging: DecodeStaging | None = model.decode_staging(self.sizes[-1], device)
        self.slot_groups = [g for g, lay in enumerate(self.groups) if lay.compress_ratio == 1]
        self.inputs = StaticDecodeInputs(self.sizes[-1], self.slot_groups, device)
        self.pad_row = tables.reserve_row()      # all null blocks, never assigned a request
        # (size, context bucket or None: the whole tables) -> replay
        self._replays: dict[tuple[int, int | None], Callable[[], torch.Tensor]] = {}
        self.buckets: tuple[int, ...] = ()       # context_buckets(), for CUDA graphs only
        self._tables: list[torch.Tensor] | None = None   # device tables the replays were made on

    @property
    def num_replays(self) -> int:
        """Replays made so far (with CUDA graphs: the graphs captured, sizes x buckets)."""
        return len(self._replays)

    # ------------------------------------------------------------------------ setup
    def reserve_tables(self, max_model_len: int) -> None:
        """Grow the block tables once to every row and block a run can need, so their device
        tensors keep their address (a CUDA graph bakes it in)."""
        widths = [math.ceil(max_model_len / lay.block_size) + 1 for lay in self.groups]
        self.tables.reserve(self.sizes[-1] + 1, widths)

    def capture(self, max_model_len: int) -> None:
        """With CUDA graphs: reserve the block tables, then capture every size and context
        bucket, largest first, over all-padding batches (which write only the null block).
        Eager replays need neither: they are made on first use, over the whole tables."""
        if isinstance(self.capturer, EagerReplay):
            return
        self.reserve_tables(max_model_len)
        self.buckets = context_buckets(max_model_len)
        self._capturing = True
        try:
            for n in reversed(self.sizes):
                for ctx in reversed(self.buckets):
                    self._stage_padding(0, n)
                    if self.staging is not None:
                        self.staging.stage([], [], [], n)
                    self.inputs.upload(n)
                    self._replays[n, ctx] = self.capturer.capture(self._forward_over(n, ctx))
        finally:
            self._capturing = False
        self._tables = self._current_tables()

    # ------------------------------------------------------------------------- a step
    def padded_size(self, reqs: Sequence[StepRequest]) -> int | None:
        """The size this step replays at; None when it is not a decode step or too large."""
        return padded_size(len(reqs), self.sizes) if is_decode_step(reqs) else None

    def run(self, reqs: Sequence[StepRequest], n: int) -> DecodeStep:
        """The step of `reqs`, padded to n rows: staged, uploaded, replayed."""
        self.stage(reqs, n)
        self.inputs.upload(n)
        hidden = self._replay(n, max(q.start for q in reqs) + 1)()
        return DecodeStep(hidden[:len(reqs)], self._batch(len(reqs)))

    def stage(self, reqs: Sequence[StepRequest], n: int) -> None:
        """Write the step's metadata and the padding rows into the host buffers."""
        r = len(reqs)
        host = self.inputs.host
        rows = np.fromiter((self.tables.update(q.request_id, q.block_ids, q.is_new)
                            for q in reqs), dtype=np.int64, count=r)
        pos = np.fromiter((q.start for q in reqs), dtype=np.int64, count=r)
        host["input_ids"][:r] = [q.token_ids[0] for q in reqs]
        host["positions"][:r] = pos
        host["seq_lens"][:r] = pos + 1
        host["req_rows"][:r] = rows
        for g in self.slot_groups:
            bs = self.groups[g].block_size
            host[f"slots{g}"][:r] = self.tables.host(g)[rows, pos // bs] * bs + pos % bs
        self._stage_padding(r, n)
        if self.staging is not None:
            self.staging.stage([q.token_ids[0] for q in reqs], pos,
                               [q.context for q in reqs], n)

    # ---------------------------------------------------------------------- helpers
    def _stage_padding(self, lo: int, hi: int) -> None:
        """Rows [lo, hi): token 0 at position 0 through the null-block row."""
        host = self.inputs.host
        for name in ("input_ids", "positions"):
            host[name][lo:hi] = 0
        host["seq_lens"][lo:hi] = 1
        host["req_rows"][lo:hi] = self.pad_row
        for g in self.slot_groups:
            host[f"slots{g}"][lo:hi] = 0              # slot 0 of the null block

    def _replay(self, n: int, context: int) -> Callable[[], torch.Tensor]:
        """The replay of size n for a step whose longest context is `context` positions."""
        if isinstance(self.capturer, EagerReplay):
            if (n, None) not in self._replays:
                self._replays[n, None] = self.capturer.capture(self._forward_over(n, None))
            return self._replays[n, None]
        i = bisect.bisect_left(self.buckets, context)
        key = (n, self.buckets[i]) if i < len(self.buckets) else (n, context)
        if self._tables is None or key not in self._replays:
            raise RuntimeError(f"decode size {n} at context {context} was not captured (call "
                               f"capture() at startup with max_model_len >= {context})")
        if any(a is not b for a, b in zip(self._current_tables(), self._tables)):
            # A table outgrew its reservation (a new tensor): the graphs read the old one.
            logger.warning("block tables were reallocated; decode steps now replay eagerly")
            self.capturer, self._replays, self._tables = EagerReplay(), {}, None
            self.buckets = ()
            return self._replay(n, context)
        return self._replays[key]

    def _forward_over(self, n: int, context: int | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            # A fresh batch object per call: a model may keep per-step state in batch.extras.
            if self.step_sync is None or not self._capturing:
                return self.model.forward(self._batch(n, context))
            # Capture: every rank runs this size now. A replay's step was agreed before it
            # (ModelRunner.forward: begin_step), so it runs the forward alone.
            with self.step_sync.fixed_step(n):
                return self.model.forward(self._batch(n, context))
        return run

    def _current_tables(self) -> list[torch.Tensor]:
        return [self.tables.device_table(g) for g in range(len(self.groups))]

    def _batch(self, n: int, context: int | None = None) -> ForwardBatch:
        """The first n rows of the static buffers as the model's batch; context: the block
        tables narrowed to the blocks of that many positions (a view: same address)."""
        dev, host = self.inputs.dev, self.inputs.host
        rows, rows_cpu = dev["req_rows"][:n], host["req_rows"][:n]
        views = []
        for g, lay in enumerate(self.groups):
            slots = dev[f"slots{g}"][:n] if lay.compress_ratio == 1 else None
            table = self.tables.device_table(g)
            if context is not None:
                table = table[:, :-(-context // lay.block_size)]
            views.append(KVGroupView(lay.block_size, lay.compress_ratio, table,
                                     slot_mapping=slots, req_rows=rows, req_rows_cpu=rows_cpu))
        return ForwardBatch(
            input_ids=dev["input_ids"][:n], positions=dev["positions"][:n],
            query_start_loc=dev["query_start_loc"][:n + 1], seq_lens=dev["seq_lens"][:n],
            query_start_loc_cpu=host["query_start_loc"][:n + 1],
            seq_lens_cpu=host["seq_lens"][:n], kv_caches=self.kv_caches, kv_groups=views,
            cache_group=self.cache_group,
            extras={} if self.staging is None else self.staging.inputs(n))
