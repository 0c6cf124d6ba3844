"""Causal grouped-query attention over the paged K||V cache, batched across requests
(backend "batched").

Same maths as paged_attention.py (the per-request reference, and the oracle the tests hold
this to), in a constant number of torch ops per layer instead of a loop over requests.

Glossary:
- segment: consecutive query rows of one request attended together: the request's new tokens,
  or one chunk of a long prefill (chunks keep one call's scores under MAX_SCORE_ELEMENTS).
  A segment's keys are positions [lo, hi): hi is one past its last query; lo is 0 (full
  attention) or its first query's position - window + 1, as in the reference.
- bucket: segments padded to a common [Q queries, L keys] and run through one SDPA call.
  Segments are bucketed greedily, longest first: a segment joins the open bucket unless its
  scores would pass the budget, or the padding would more than double the bucket's work (and
  the bucket is not so small, SMALL_ELEMENTS, that padding costs less than another call).
  Decodes therefore never pad up to a prefill chunk's length, and a pure decode step or a step
  of equal-length prefills is a single bucket.

Padding never reads another request's or a stale entry: a padded key gathers the slot of its
segment's first key (written, in the window, this request's) and has a position past every
query of the segment, so the causal mask hides it; a padded query repeats the segment's last
query and its output is dropped. Nothing gathered is NaN, so no 0 * NaN can reach an output.

Grouped-query heads are folded into the query axis ([n, Hkv, Q*G, D], query head h = kv head
h // G), so SDPA sees plain multi-head attention: no repeat_interleave copies of K/V, and GPU
fused kernels that take a mask apply.

Two ways to attend a bucket, picked by its shape (docs/cpu_kernels.md):
- SDPA (prefill-shaped buckets): the fused kernel over [n, Hkv, Q*G, D] queries;
- two batched GEMMs (decode-shaped buckets, Q*G <= MATMUL_MAX_ROWS query rows per KV head):
  scores = q @ k^T in the model dtype, softmax in fp32 over the scores plus an additive mask,
  then p @ v, as transformers' eager attention does. On the CPU the fused SDPA kernel spends
  most of its time on per-(segment, head) setup when each has only a handful of query rows
  (measured 2-3x slower than the GEMMs here, BENCHMARKS.md "CPU kernels").

Index tensors and masks depend only on the step's batch, the cache group, the window and the
head count, so `PagedAttentionPlans` builds each plan once per step for all layers.

On the CPU, when the C++ extension is built (wideserve/kernels/loader.py), every segment goes
instead to `torch.ops.wideserve.paged_attention` (wideserve/kernels/csrc/paged_attention.cpp),
which reads the paged cache in place through the block table: no gather, no padding, no plan,
an online softmax in fp32 per (request, query block) over all KV heads. It is faster than the
buckets at every shape measured, decode and prefill (docs/cpu_kernels.md); the buckets stay
the path on other devices, for other dtypes, and where the extension failed to build. Its
`paged_attention_write` form also stores the step's K/V entries first (one call per layer, no
torch.cat + index_copy_); a prefix replay, which writes only some rows, keeps the torch write
and the plain op.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from wideserve.utils.device import to_device
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.kernels.choice import bucket_of, default_choice
from wideserve.kernels.loader import cpu_ops_available
from wideserve.layers.attention.paged_prefill import ContextSplit, attend_split, build_split

MAX_SCORE_ELEMENTS = 1 << 24      # heads * queries * keys of one SDPA call (64 MiB in fp32)
SMALL_ELEMENTS = 1 << 16          # buckets this small merge whatever their padding costs
MATMUL_MAX_ROWS = 16              # folded query rows (Q*G) up to which a bucket uses two GEMMs
KERNEL_DTYPES = (torch.float32, torch.bfloat16)   # q and cache dtypes the C++ op takes


@dataclass(frozen=True, slots=True)
class PagedAttentionConfig:
    """Which CPU paths the op may take; the defaults are the fast ones, False is for A/B runs
    and tests. A model holds one (DecoderModel.attention_config, from the engine's
    KernelConfig) and hands it to each step's PagedAttentionPlans."""

    cpu_kernel: bool = True          # the C++ op on the CPU (False: the buckets)
    sdpa_prefill: bool = True        # fresh prefills through SDPA where the choice measured it
    fused_kv_write: bool = True      # the op writes the step's K/V itself (False: torch write)
    sdpa_context: bool = True        # chunked / mixed prefills through SDPA where measured
                                     # faster (layers/attention/paged_prefill.py)
    # KernelConfig.batch_invariant: never SDPA, fresh prefills (whether a request took it
    # depended on the others in the step) or chunks (it depends on the chunk's length): the
    # C++ op for every row, whose result for a query depends on its position alone
    batch_invariant: bool = False


@dataclass(slots=True)
class _Bucket:
    """n segments padded to Q queries and L keys each."""

    n: int
    q: int
    l: int
    q_rows: torch.Tensor              # [n*Q] token row of each padded query
    slots: torch.Tensor               # [n*L] cache slot of each padded key
    mask: torch.Tensor | None         # [n, 1, Q, L] key visible to query; None: all visible
    keep: torch.Tensor | None         # [V] which of the n*Q padded queries are real; None: all
    out_rows: torch.Tensor            # [V] token rows of the real ones
    folded: dict[int, torch.Tensor] = field(default_factory=dict)   # G -> [n, 1, Q*G, L]
    bias: dict[int, torch.Tensor | None] = field(default_factory=dict)  # G -> additive fp32

    def folded_mask(self, groups: int) -> torch.Tensor | None:
        """The mask for queries folded as row q*G + g (see module docstring)."""
        if self.mask is None or self.q == 1:
            return self.mask                     # one row per segment broadcasts over G
        if groups not in self.folded:
            n, q, l = self.n, self.q, self.l
            self.folded[groups] = self.mask[:, :, :, None, :].expand(
                n, 1, q, groups, l).reshape(n, 1, q * groups, l)
        return self.folded[groups]

    def folded_bias(self, groups: int) -> torch.Tensor | None:
        """folded_mask as an additive fp32 mask (0 visible, -inf hidden)."""
        if groups not in self.bias:
            mask = self.folded_mask(groups)
            self.bias[groups] = None if mask is None else torch.zeros(
                mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
                    ~mask, float("-inf"))
        return self.bias[groups]


@dataclass(slots=True)
class _WritePlan:
    slots: torch.Tensor               # [N] cache slots to write
    rows: torch.Tensor | None         # [N] token rows they take; None: every row, in order


@dataclass(slots=True)
class _Plan:
    buckets: list[_Bucket]
    identity: bool       # one bucket covering rows 0..T-1 in order: its output is the result


class PagedAttentionPlans:
    """Per-step cache of attention plans; build one per forward and hand it to every layer."""

    def __init__(self, batch: ForwardBatch, max_score_elements: int | None = None,
                 config: PagedAttentionConfig | None = None) -> None:
        """max_score_elements: per-call budget of heads x queries x keys (MAX_SCORE_ELEMENTS);
        config: the paths the op may take (None: the defaults)."""
        self.batch = batch
        self.config = PagedAttentionConfig() if config is None else config
        self.max_score_elements = (MAX_SCORE_ELEMENTS if max_score_elements is None
                                   else max_score_elements)
        self._plans: dict[tuple[int, int | None, int], _Plan] = {}
        self._writes: dict[tuple[int, bool], _WritePlan] = {}
        self._sdpa: dict[tuple, list[int] | None] = {}
        self._split: dict[tuple, ContextSplit | None] = {}

    def sdpa_prefill(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     window: int | None) -> list[int] | None:
        """Each request's query length where this step attends through SDPA on its own k/v
        instead of the C++ op: every request a prefill from position 0 (its context is only
        this step's tokens), no window, and the kernel choice (wideserve/kernels/choice.py,
        family "attention") measured SDPA faster at the shortest request's length; else None."""
        key = (heads, kv_heads, head_dim, dtype, window)
        if key not in self._sdpa:
            self._sdpa[key] = None
            b = self.batch
            if self.config.sdpa_prefill and not self.config.batch_invariant \
                    and window is None and len(b.seq_lens_cpu):
                q = b.query_lens_cpu()
                if np.array_equal(q, b.seq_lens_cpu) and q.min() > 1:
                    plan = default_choice().plan_attention(heads, kv_heads, head_dim, dtype)
                    if plan[bucket_of(int(q.min()))] == "sdpa":
                        self._sdpa[key] = q.tolist()
        return self._sdpa[key]

    def context_split(self, cache_name: str, heads: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, window: int | None) -> ContextSplit | None:
        """The step's requests that attend through SDPA although the step is not all fresh
        prefills (a chunk after cached positions, prefills beside decodes), where the kernel
        choice measured SDPA faster at their query length (layers/attention/paged_prefill.py);
        None: every request goes to the C++ op. Never in --batch-invariant: whether a request
        takes SDPA follows its chunk's length (the scheduler's split), and SDPA rounds a row
        differently from the op, so a prompt prefilled whole and in chunks would differ."""
        group = self.batch.cache_group[cache_name]
        key = (group, heads, kv_heads, head_dim, dtype, window)
        if key not in self._split:
            self._split[key] = None
            if self.config.sdpa_context and not self.config.batch_invariant \
                    and window is None and len(self.batch.seq_lens_cpu):
                choice = default_choice()
                self._split[key] = build_split(
                    self.batch, self.batch.kv_groups[group],
                    choice.plan_attention(heads, kv_heads, head_dim, dtype),
                    choice.plan_attention(heads, kv_heads, head_dim, dtype, context=True))
        return self._split[key]

    def attention(self, cache_name: str, window: int | None, num_heads: int) -> _Plan:
        key = (self.batch.cache_group[cache_name], window, num_heads)
        if key not in self._plans:
            view = self.batch.kv_groups[key[0]]
            self._plans[key] = _build_plan(self.batch, view, window, num_heads,
                                           self.max_score_elements)
        return self._plans[key]

    def write(self, cache_name: str, window: int | None) -> _WritePlan:
        # Replayed prefix positions are rewritten only where the cache is a window.
        key = (self.batch.cache_group[cache_name], window is None)
        if key not in self._writes:
            view = self.batch.kv_groups[key[0]]
            rows = self.batch.replay_write_rows_cpu() if window is None else None
            self._writes[key] = _build_write(view, rows)
        return self._writes[key]


def _build_write(view: KVGroupView, rows: np.ndarray | None) -> _WritePlan:
    """rows: the token rows to write (host-known, so no device sync); None = all."""
    if view.slot_mapping is None:
        raise ValueError("paged attention needs a slot mapping (compress_ratio 1 group)")
    if rows is None:
        return _WritePlan(view.slot_mapping, None)
    rows_t = to_device(rows, view.slot_mapping.device, np.int64)
    return _WritePlan(view.slot_mapping.index_select(0, rows_t), rows_t)


def _segments(qsl: np.ndarray, seq_lens: np.ndarray, window: int | None, heads: int,
              budget: int) -> tuple[np.ndarray, ...]:
    """(request, first token row, query count, first query position, key lo, key count) of
    every segment; a request is chunked when its queries x keys x heads pass `budget`."""
    qlen = np.diff(qsl)
    active = np.nonzero(qlen > 0)[0]
    qlen_a, seq_a = qlen[active], seq_lens[active]
    span = seq_a if window is None else np.minimum(seq_a, qlen_a + window - 1)
    chunk = np.maximum(1, budget // (heads * np.maximum(span, 1)))
    nchunks = -(-qlen_a // chunk)
    req = np.repeat(active, nchunks)
    local = np.repeat(np.arange(len(active)), nchunks)
    idx = np.arange(int(nchunks.sum())) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)
    q0 = idx * chunk[local]                                   # offset within the request
    qn = np.minimum(chunk[local], qlen_a[local] - q0)
    pos0 = seq_a[local] - qlen_a[local] + q0
    lo = np.zeros_like(pos0) if window is None else np.maximum(0, pos0 - window + 1)
    return req, qsl[req] + q0, qn, pos0, lo, pos0 + qn - lo


def _group(qn: np.ndarray, kn: np.ndarray, heads: int, budget: int) -> list[np.ndarray]:
    """Segment indices per bucket (greedy, longest first; see module docstring)."""
    order = np.lexsort((-kn, -qn))
    groups, start, total = [], 0, len(order)
    while start < total:
        first = order[start]
        q, l, work, end = int(qn[first]), int(kn[first]), int(qn[first] * kn[first]), start + 1
        while end < total:
            s = order[end]
            new_l, new_work = max(l, int(kn[s])), work + int(qn[s] * kn[s])
            padded = (end - start + 1) * q * new_l
            scores = padded * heads
            if scores > budget or (scores > SMALL_ELEMENTS and padded > 2 * new_work):
                break
            l, work, end = new_l, new_work, end + 1
        groups.append(np.sort(order[start:end]))   # token order: a lone bucket needs no scatter
        start = end
    return groups


def _build_plan(batch: ForwardBatch, view: KVGroupView, window: int | None, heads: int,
                budget: int) -> _Plan:
    req, row0, qn, pos0, lo, kn = _segments(batch.query_start_loc_cpu, batch.seq_lens_cpu,
                                            window, heads, budget)
    buckets = [_build_bucket(view, window, req[g], row0[g], qn[g], pos0[g], lo[g], kn[g])
               for g in _group(qn, kn, heads, budget)]
    # Segments are made in token order and each bucket keeps them sorted, so a lone unpadded
    # bucket holding every token reads rows 0..T-1 in order.
    identity = (len(buckets) == 1 and buckets[0].keep is None
                and buckets[0].n * buckets[0].q == batch.num_tokens)
    return _Plan(buckets, identity)


def _build_bucket(view: KVGroupView, window: int | None, req: np.ndarray, row0: np.ndarray,
                  qn: np.ndarray, pos0: np.ndarray, lo: np.ndarray, kn: np.ndarray) -> _Bucket:
    n, q, l = len(req), int(qn.max()), int(kn.max())
    dev = view.block_table.device
    qi = np.minimum(np.arange(q)[None, :], qn[:, None] - 1)        # [n, Q] padding -> last
    q_rows = (row0[:, None] + qi).reshape(-1)
    real = (np.arange(q)[None, :] < qn[:, None]).reshape(-1)
    keep = None if real.all() else np.nonzero(real)[0]
    out_rows = q_rows if keep is None else q_rows[keep]

    def t(a: np.ndarray) -> torch.Tensor:
        return to_device(a, dev, np.int64)

    j = torch.arange(l, device=dev)[None, :]                        # [1, L]
    lo_t, kn_t = t(lo)[:, None], t(kn)[:, None]
    key_pos = lo_t + j                                              # [n, L] padding past hi
    slot_pos = torch.where(j < kn_t, key_pos, lo_t)                 # padding -> first key
    slots = view.entry_slots(t(req)[:, None], slot_pos).reshape(-1)
    mask = None
    if q > 1 or bool((kn != l).any()):
        q_pos = t(pos0[:, None] + qi)                               # [n, Q]
        visible = key_pos[:, None, :] <= q_pos[:, :, None]          # [n, Q, L]
        if window is not None:
            visible &= key_pos[:, None, :] > q_pos[:, :, None] - window
        mask = visible[:, None]
    return _Bucket(n, q, l, t(q_rows), slots, mask, None if keep is None else t(keep),
                   t(out_rows))


def _attend_bucket(b: _Bucket, flat: torch.Tensor, q: torch.Tensor, num_kv_heads: int,
                   scale: float) -> torch.Tensor:
    """Outputs [n*Q, H, D] of the bucket's padded queries."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    g = num_heads // num_kv_heads
    if b.q * g <= MATMUL_MAX_ROWS:
        return _attend_bucket_matmul(b, flat, q, num_kv_heads, scale)
    entries = flat.index_select(0, b.slots).to(q.dtype).view(b.n, b.l, 2, num_kv_heads, head_dim)
    keys = entries[:, :, 0].transpose(1, 2)                                   # [n, Hkv, L, D]
    values = entries[:, :, 1].transpose(1, 2)                                 # [n, Hkv, L, D]
    queries = q.index_select(0, b.q_rows).view(b.n, b.q, num_kv_heads, g, head_dim)
    queries = queries.transpose(1, 2).reshape(b.n, num_kv_heads, b.q * g, head_dim)
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=b.folded_mask(g),
                                       scale=scale)                          # [n, Hkv, Q*G, D]
    o = o.view(b.n, num_kv_heads, b.q, g, head_dim).transpose(1, 2)           # [n, Q, Hkv, G, D]
    return o.reshape(b.n * b.q, num_heads, head_dim)


def _attend_bucket_matmul(b: _Bucket, flat: torch.Tensor, q: torch.Tensor, num_kv_heads: int,
                          scale: float) -> torch.Tensor:
    """_attend_bucket as two batched GEMMs over [n*Hkv] (Q*G x L) score blocks."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    g, n, rows = num_heads // num_kv_heads, b.n, b.q * num_heads // num_kv_heads
    entries = flat.index_select(0, b.slots).to(q.dtype).view(n, b.l, 2, num_kv_heads, head_dim)
    # [n*Hkv, L, D] keys and values (one copy each when Hkv > 1: the cache is position-major)
    keys = entries[:, :, 0].transpose(1, 2).reshape(n * num_kv_heads, b.l, head_dim)
    values = entries[:, :, 1].transpose(1, 2).reshape(n * num_kv_heads, b.l, head_dim)
    queries = q.index_select(0, b.q_rows).view(n, b.q, num_kv_heads, g, head_dim)
    queries = queries.transpose(1, 2).reshape(n * num_kv_heads, rows, head_dim)
    scores = torch.bmm(queries, keys.transpose(1, 2)).view(n, num_kv_heads, rows, b.l)
    scores = scores.float().mul_(scale)
    bias = b.folded_bias(g)                                                  # [n, 1, rows, L]
    if bias is not None:
        scores.add_(bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(n * num_kv_heads, rows, b.l)
    o = torch.bmm(probs, values).view(n, num_kv_heads, b.q, g, head_dim).transpose(1, 2)
    return o.reshape(n * b.q, num_heads, head_dim)


def cpu_kernel_applies(q: torch.Tensor, cache: torch.Tensor, enabled: bool = True) -> bool:
    """Whether this call runs the C++ op (see the module docstring); enabled:
    PagedAttentionConfig.cpu_kernel."""
    return (enabled and q.device.type == "cpu" and q.dtype in KERNEL_DTYPES
            and cache.dtype in KERNEL_DTYPES and cpu_ops_available())


def paged_attention_kernel(q: torch.Tensor, cache: torch.Tensor, view: KVGroupView,
                           batch: ForwardBatch, scale: float, window: int | None,
                           portable: bool = False, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ op over every request of the step ([T, H, D], q's dtype). Without k/v this
    step's entries must already be in the cache; with k/v [T, Hkv, D] the op first writes
    every token's entry at the view's slot mapping (one call, no torch.cat/index_copy_).
    portable: force its plain C++ loop (no AVX512)."""
    if view.block_size != cache.shape[1]:
        raise ValueError(f"block size {view.block_size} != cache entries per block "
                         f"{cache.shape[1]} (paged attention needs compress_ratio 1)")
    w = 0 if window is None else window
    if k is None:
        return torch.ops.wideserve.paged_attention(
            q, cache, view.block_table, view.req_rows, batch.query_start_loc, batch.seq_lens,
            scale, w, portable)
    return torch.ops.wideserve.paged_attention_write(
        q, k, v, cache, view.slot_mapping, view.block_table, view.req_rows,
        batch.query_start_loc, batch.seq_lens, scale, w, portable)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                 scale: float) -> torch.Tensor:
    """Causal attention of requests that are whole prefills, on the step's own q/k/v (the
    cache holds nothing else of them): torch's fused SDPA per request (one call for equal
    lengths), whose CPU kernel runs its GEMMs on brgemm (AMX where present). [T, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]

    def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        # [R, L, H, D] -> [R, H, L, D] views; the output back to [R, L, H, D]
        o = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2),
                                           vs.transpose(1, 2), is_causal=True, scale=scale,
                                           enable_gqa=heads != kv_heads)
        return o.transpose(1, 2)

    if min(lens) == max(lens):
        n, L = len(lens), lens[0]
        o = attend(q.view(n, L, heads, -1), k.view(n, L, kv_heads, -1),
                   v.view(n, L, kv_heads, -1))
        return o.reshape(q.shape)
    out = q.new_empty(q.shape)
    start = 0
    for L in lens:
        rows = slice(start, start + L)
        out[rows] = attend(q[rows][None], k[rows][None], v[rows][None])[0]
        start += L
    return out


def paged_attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            batch: ForwardBatch, cache_name: str, scale: float,
                            window: int | None = None,
                            plans: PagedAttentionPlans | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (k already rotated) -> [T, H, D]; the reference's contract.

    plans: the step's PagedAttentionPlans (shared by the layers); None builds a fresh one."""
    cache, view = batch.cache(cache_name)
    if view.compress_ratio != 1:
        raise ValueError(f"{cache_name}: paged attention needs compress_ratio 1, "
                         f"got {view.compress_ratio}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{cache_name}: {num_heads} query heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    if 2 * num_kv_heads * head_dim != cache.shape[-1]:
        raise ValueError(f"KV entry width {2 * num_kv_heads * head_dim} != cache width "
                         f"{cache.shape[-1]}")
    plans = PagedAttentionPlans(batch) if plans is None else plans
    wp = plans.write(cache_name, window)
    kernel = cpu_kernel_applies(q, cache, plans.config.cpu_kernel) and k.dtype in KERNEL_DTYPES
    lens = plans.sdpa_prefill(num_heads, num_kv_heads, head_dim, q.dtype, window) \
        if kernel and wp.rows is None else None
    split = plans.context_split(cache_name, num_heads, num_kv_heads, head_dim, q.dtype,
                                window) if kernel and wp.rows is None and lens is None else None
    if kernel and wp.rows is None and plans.config.fused_kv_write and lens is None \
            and split is None:
        # The op writes every token's entry and attends, in one call.
        return paged_attention_kernel(q, cache, view, batch, scale, window, k=k, v=v)
    flat = cache.view(-1, cache.shape[-1])                                    # [slots, W]
    if kernel and wp.rows is None and plans.config.fused_kv_write and cache.is_contiguous():
        # The op's write alone (SDPA or flash attends next): one pass, no concatenated copy
        # (2,048 tokens of the 653M model into a warm cache: 0.23 ms against 0.63 for torch's
        # cat + index_copy_; into a step's fresh blocks both cost ~2 ms of cold writes).
        torch.ops.wideserve.paged_kv_write(k, v, cache, wp.slots)
    else:
        entries = torch.cat((k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)), dim=-1)
        if wp.rows is not None:
            # Prefix replay: a FULL cache already holds the entries below kv_write_start.
            entries = entries.index_select(0, wp.rows)
        flat.index_copy_(0, wp.slots, entries.to(flat.dtype))
    if lens is not None:
        return sdpa_prefill(q, k, v, lens, scale)
    if split is not None:
        return attend_split(q, k, v, cache, view, split, scale)
    if kernel:
        return paged_attention_kernel(q, cache, view, batch, scale, window)

    plan = plans.attention(cache_name, window, num_heads)
    if plan.identity:
        return _attend_bucket(plan.buckets[0], flat, q, num_kv_heads, scale)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for b in plan.buckets:
        o = _attend_bucket(b, flat, q, num_kv_heads, scale)
        out.index_copy_(0, b.out_rows, o if b.keep is None else o.index_select(0, b.keep))
    return out
