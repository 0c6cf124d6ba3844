"""The reference sampler: one batched pass from logits [R, V] to one token per request.

Order of operations (vLLM v1's order):
  raw logits -> grammar mask (structured outputs) -> logit_bias -> min_tokens mask (stop ids to -inf) ->
  penalties (repetition over prompt+output, frequency/presence over output) -> greedy rows:
  argmax -> random rows: temperature -> min_p -> top_k -> top_p -> exp (the weights up to each
  row's normaliser) -> one inverse-CDF draw per row (sample_categorical). On a CPU, top-p
  looks at each row's most probable tokens before it sorts a whole row (the sort only where
  the nucleus may reach past them).
Logprobs are "raw" (vLLM's default `logprobs_mode="raw_logprobs"`): log_softmax of the logits as
the model produced them, before the mask, penalties or temperature. Rank = 1 + the number of
tokens with a strictly larger logprob (ties share the best rank).

Randomness: a row that has a generator (the request set a seed) draws its one uniform per step
from it, so its samples depend only on its own logits and its own generator: the same across
runs and whatever else is in the batch. Other rows share the default torch RNG. The draw
needs no multinomial and no host sync, and one random number per row, not one per token
(docs/host_path.md, "Random sampling").

SamplingMetadata is built once per step with numpy from the requests' params (a loop per
request to read fields, never per token); tensors that no row needs are left None so the common
cases (all greedy, plain temperature) skip whole stages. The engine keeps the penalty counts
per request across steps (worker/penalties.py) and passes them in; rebuilding them from the
full histories here is the reference and the default for other callers.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from wideserve.utils.device import to_device
from wideserve.kernels.loader import cpu_ops_available
from wideserve.types.sampling_params import SAMPLING_EPS, SamplingParams
from wideserve.worker.grammar_mask import GrammarMask

_NEG_INF = float("-inf")


@dataclass(slots=True)
class PenaltyState:
    """Penalty inputs for the P rows that use any penalty (the others are untouched)."""
    rows: torch.Tensor                 # [P] int64, row index into the batch
    presence: torch.Tensor             # [P] fp32
    frequency: torch.Tensor            # [P] fp32
    repetition: torch.Tensor           # [P] fp32
    output_counts: torch.Tensor        # [P, V] fp32, occurrences of each token in the output
    seen: torch.Tensor | None          # [P, V] bool, token in prompt or output; None if no row
                                       # uses repetition_penalty


@dataclass(slots=True)
class SamplingMetadata:
    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None   # [R] fp32 (greedy rows hold 1.0); None if all greedy
    greedy_mask: torch.Tensor | None   # [R] bool; only when greedy and random rows mix
    top_k: torch.Tensor | None         # [R] int64 in [1, V] (V = off); None if no row uses it
    max_top_k: int                     # largest k in use (host copy: no device sync)
    top_p: torch.Tensor | None         # [R] fp32 in (0, 1]; None if no row uses it
    min_p: torch.Tensor | None         # [R] fp32 in [0, 1]; None if no row uses it
    generators: Mapping[int, torch.Generator]
    penalties: PenaltyState | None
    stop_mask_rows: torch.Tensor | None  # [M] int64 \ (row, token) pairs set to -inf while a
    stop_mask_cols: torch.Tensor | None  # [M] int64 / request is below min_tokens
    max_num_logprobs: int | None       # max top-N over rows asking for logprobs; None = no row
    grammar: GrammarMask | None = None  # structured outputs: allowed tokens of constrained rows
    # logit_bias: (row, token) pairs and the bias added to that logit; None if no row has one
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class LogprobsTensors:
    """Column 0 is the chosen token (sampled or prompt target), columns 1..N the top N."""
    token_ids: torch.Tensor            # [R, N+1] int64
    logprobs: torch.Tensor             # [R, N+1] fp32
    ranks: torch.Tensor                # [R] int64, rank of the column-0 token (1 = best)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor            # [R] int64
    logprobs: LogprobsTensors | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator; the runner keeps it for the request's whole life."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# ---- building the metadata ----------------------------------------------------------------

def _flat_ids(lists: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-row id lists -> (row index per id, ids)."""
    arrays = [np.asarray(x, dtype=np.int64).reshape(-1) for x in lists]
    lens = np.array([a.size for a in arrays], dtype=np.int64)
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return np.repeat(np.arange(len(arrays), dtype=np.int64), lens), ids


def check_ids(ids: np.ndarray, vocab_size: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{what} holds token ids outside [0, {vocab_size}): "
                         f"min {ids.min()}, max {ids.max()}")


def _build_penalties(
    params_list: Sequence[SamplingParams],
    output_token_ids_list: Sequence[Sequence[int] | np.ndarray],
    prompt_token_ids_list: Sequence[Sequence[int] | np.ndarray] | None,
    device: torch.device,
    vocab_size: int,
) -> PenaltyState | None:
    rows = np.array([i for i, p in enumerate(params_list) if p.has_penalties], dtype=np.int64)
    if rows.size == 0:
        return None
    sel = [params_list[i] for i in rows]
    pres = np.array([p.presence_penalty for p in sel], dtype=np.float32)
    freq = np.array([p.frequency_penalty for p in sel], dtype=np.float32)
    rep = np.array([p.repetition_penalty for p in sel], dtype=np.float32)
    out_rows, out_ids = _flat_ids([output_token_ids_list[i] for i in rows])
    check_ids(out_ids, vocab_size, "output_token_ids_list")
    counts = torch.zeros(rows.size, vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((to_device(out_rows, device), to_device(out_ids, device)),
                      torch.ones(out_ids.size, dtype=torch.float32, device=device),
                      accumulate=True)
    seen = None
    if (rep != 1.0).any():
        if prompt_token_ids_list is None:
            raise ValueError("prompt_token_ids_list is required when a request sets "
                             "repetition_penalty")
        pr_rows, pr_ids = _flat_ids([prompt_token_ids_list[i] for i in rows])
        check_ids(pr_ids, vocab_size, "prompt_token_ids_list")
        seen = counts > 0
        seen[to_device(pr_rows, device), to_device(pr_ids, device)] = True
    return PenaltyState(rows=to_device(rows, device), presence=to_device(pres, device),
                        frequency=to_device(freq, device), repetition=to_device(rep, device),
                        output_counts=counts, seen=seen)


def _build_stop_mask(
    params_list: Sequence[SamplingParams],
    num_outputs: np.ndarray,
    eos_token_ids: frozenset[int],
    device: torch.device,
    vocab_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    min_tokens = np.array([p.min_tokens for p in params_list], dtype=np.int64)
    below = np.nonzero(num_outputs < min_tokens)[0]
    rows: list[int] = []
    cols: list[int] = []
    for i in below:  # one iteration per request still under min_tokens
        ids = sorted(t for t in params_list[i].all_stop_token_ids(eos_token_ids) if t < vocab_size)
        rows.extend([int(i)] * len(ids))
        cols.extend(ids)
    if not rows:
        return None, None
    return (to_device(np.array(rows, dtype=np.int64), device),
            to_device(np.array(cols, dtype=np.int64), device))


def _build_bias(params_list: Sequence[SamplingParams], device: torch.device,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params_list):     # one iteration per request with a logit_bias
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t < vocab_size:
                    rows.append(i)
                    cols.append(t)
                    vals.append(b)
    if not rows:
        return None
    return (to_device(np.array(rows, dtype=np.int64), device),
            to_device(np.array(cols, dtype=np.int64), device),
            to_device(np.array(vals, dtype=np.float32), device))


REBUILD = object()   # build_sampling_metadata(penalties=...): rebuild from the histories


def plain_greedy(params_list: Sequence[SamplingParams], num_outputs: Sequence[int]) -> bool:
    """True when every row is greedy with nothing to apply before the argmax: no logprobs,
    logit_bias or penalties, and past min_tokens (no stop-id mask). The grammar mask is
    the caller's to check. Then the sampler's answer is argmax_rows(logits.float()), and a
    decode step skips building SamplingMetadata (a numpy pass over every field of every
    row: ~0.1 ms a step, docs/host_path.md)."""
    for p, n in zip(params_list, num_outputs):
        if (not p.is_greedy or p.logprobs is not None or p.logit_bias
                or p.has_penalties or n < p.min_tokens):
            return False
    return True


def build_sampling_metadata(
    params_list: Sequence[SamplingParams],
    output_token_ids_list: Sequence[Sequence[int] | np.ndarray],
    prompt_token_ids_list: Sequence[Sequence[int] | np.ndarray] | None,
    generators: Mapping[int, torch.Generator],
    device: torch.device | str,
    vocab_size: int,
    eos_token_ids: Iterable[int] = (),
    penalties: PenaltyState | None | object = REBUILD,
) -> SamplingMetadata:
    """Batch the step's sampling inputs. Row i of every list is request i of the logits.

    penalties: the step's PenaltyState when the caller keeps it incrementally
    (worker/penalties.py's PenaltyTracker: the engine does); by default it is rebuilt here
    from the full output (and prompt) histories, the reference the tracker is tested against.

    generators maps row -> that request's own generator (see make_generator); every row whose
    params set a seed must have one, since a fresh generator per step would repeat its noise.
    prompt_token_ids_list is only read for rows with repetition_penalty != 1 (the runner may
    pass cached numpy arrays). eos_token_ids are masked, with stop_token_ids, below min_tokens.
    """
    device = torch.device(device)
    num_reqs = len(params_list)
    if len(output_token_ids_list) != num_reqs:
        raise ValueError(f"output_token_ids_list has {len(output_token_ids_list)} rows, "
                         f"params_list has {num_reqs}")
    if prompt_token_ids_list is not None and len(prompt_token_ids_list) != num_reqs:
        raise ValueError(f"prompt_token_ids_list has {len(prompt_token_ids_list)} rows, "
                         f"params_list has {num_reqs}")
    for i, p in enumerate(params_list):
        if p.seed is not None and i not in generators:
            raise ValueError(f"generators: row {i} sets seed={p.seed} but has no generator")

    temp = np.array([p.temperature for p in params_list], dtype=np.float32)
    greedy = temp < SAMPLING_EPS
    all_greedy = bool(greedy.all())
    all_random = not all_greedy and not bool(greedy.any())
    top_k = np.array([p.top_k for p in params_list], dtype=np.int64)
    top_k = np.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    top_p = np.array([p.top_p for p in params_list], dtype=np.float32)
    min_p = np.array([p.min_p for p in params_list], dtype=np.float32)
    use_k, use_p, use_min_p = (top_k < vocab_size).any(), (top_p < 1.0).any(), (min_p > 0).any()
    nlp = [p.logprobs for p in params_list if p.logprobs is not None]
    num_outputs = np.array([len(o) for o in output_token_ids_list], dtype=np.int64)
    rows, cols = _build_stop_mask(params_list, num_outputs, frozenset(eos_token_ids), device,
                                  vocab_size)
    random = not all_greedy
    return SamplingMetadata(
        num_reqs=num_reqs,
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=to_device(np.where(greedy, 1.0, temp).astype(np.float32), device) if random else None,
        greedy_mask=to_device(greedy, device) if not (all_greedy or all_random) else None,
        top_k=to_device(top_k, device) if random and use_k else None,
        max_top_k=int(top_k[top_k < vocab_size].max()) if use_k else vocab_size,
        top_p=to_device(top_p, device) if random and use_p else None,
        min_p=to_device(min_p, device) if random and use_min_p else None,
        generators=generators,
        penalties=(_build_penalties(params_list, output_token_ids_list, prompt_token_ids_list,
                                    device, vocab_size)
                   if penalties is REBUILD else penalties),  # type: ignore[arg-type]
        stop_mask_rows=rows,
        stop_mask_cols=cols,
        bias=_build_bias(params_list, device, vocab_size),
        max_num_logprobs=max(nlp) if nlp else None,
    )


# ---- the sampling stages -------------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, pen: PenaltyState) -> torch.Tensor:
    """Out of place. Repetition like HF/vLLM: a seen token's logit is divided by the penalty
    when positive and multiplied when negative; then frequency * count and presence * [count>0]
    are subtracted."""
    sub = logits.index_select(0, pen.rows)                      # [P, V]
    if pen.seen is not None:
        rep = pen.repetition.unsqueeze(1)
        sub = torch.where(pen.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    counts = pen.output_counts
    sub = sub - pen.frequency.unsqueeze(1) * counts - pen.presence.unsqueeze(1) * (counts > 0)
    return logits.index_copy(0, pen.rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, in log space (no softmax needed):
    log p_i - log p_max = x_i - x_max. min_p = 0 gives log 0 = -inf, which drops nothing."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


TOP_P_CANDIDATES = 1024     # first width of apply_top_k_top_p's CPU path (no vocabulary sort)


def _nucleus_from_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                             max_top_k: int, top_p: torch.Tensor) -> torch.Tensor | None:
    """apply_top_k_top_p's top-p (after top-k) through each row's most probable tokens
    (TOP_P_CANDIDATES, then 8x as many while the nucleus reaches the last of them) instead
    of a sort of the whole vocabulary; None where that cannot give the same set: a GPU (its
    sort is fast, and the checks below would sync), a top-k wider than the candidates or
    tied past them, or a nucleus wider than an eighth of the vocabulary."""
    vocab = logits.size(1)
    width = TOP_P_CANDIDATES
    if logits.device.type != "cpu" or (top_k is not None and max_top_k > width):
        return None
    full_norm = None
    while width <= vocab // 8:
        got = _nucleus_in(logits, top_k, max_top_k, top_p, width, full_norm)
        if got is None:
            return None
        out, full_norm = got
        if out is not None:
            return out
        width *= 8
    return None


def _nucleus_in(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                top_p: torch.Tensor, width: int, full_norm: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """One try of _nucleus_from_candidates at `width` candidates: (the masked logits, or
    None when a nucleus reaches the last candidate and 8x as many might hold it; the whole
    rows' log-mass, kept for that wider try), or None when this path cannot answer."""
    vocab = logits.size(1)
    vals, idx = logits.topk(width, dim=-1)                               # descending
    no_p = top_p >= 1.0
    if top_k is None:
        off = None
    else:
        off = top_k >= vocab
        kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        kth = kth.masked_fill(off.unsqueeze(1), _NEG_INF)
        if bool(((vals[:, -1:] >= kth) & ~off.unsqueeze(1)).any()):
            return None                      # the k-th logit's ties may reach past them
        vals = vals.masked_fill(vals < kth, _NEG_INF)
    if off is None or bool(off.any()):       # rows without top-k: the whole row's mass
        if full_norm is None:
            full_norm = torch.logsumexp(logits, -1, keepdim=True)
    norm = full_norm if off is None else torch.logsumexp(vals, -1, keepdim=True)
    if off is not None and full_norm is not None:
        norm = torch.where(off.unsqueeze(1), full_norm, norm)
    probs = (vals - norm).exp_()
    # a token survives iff the mass strictly above it (in this order) is < p
    keep = (probs.cumsum(1) - probs) < top_p.unsqueeze(1)
    if bool((keep[:, -1] & ~no_p).any()):
        # 8x the candidates hold at most this mass (each new one is no more probable than
        # the last): where even that is short of p, only the sort can answer
        reach = probs.sum(1) + 7 * width * probs[:, -1]
        return None if bool(((reach < top_p) & ~no_p).any()) else (None, full_norm)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, idx, vals.masked_fill(~keep, _NEG_INF))
    if bool(no_p.any()):                     # rows without top-p: the top-k mask alone
        alone = logits if top_k is None else apply_top_k_top_p(logits, top_k, max_top_k, None)
        out = torch.where(no_p.unsqueeze(1), alone, out)
    return out, full_norm


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    # top_k [R] in [1, V] (V = off), top_p [R] in (0, 1] (1 = off); None = no row uses it
    """top_k keeps every token >= the k-th largest logit (ties at the boundary survive).
    top_p keeps, among those, the smallest most-probable set whose mass reaches p: a token
    survives iff the mass of the strictly more probable tokens is < p (so at least one)."""
    if top_p is None:
        assert top_k is not None
        # topk only as wide as the largest k in use; rows with top_k off (k = V) keep all
        top = logits.topk(max_top_k, dim=-1).values
        kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= logits.size(1)).unsqueeze(1), _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)
    fast = _nucleus_from_candidates(logits, top_k, max_top_k, top_p)
    return fast if fast is not None else top_k_top_p_by_sort(logits, top_k, top_p)


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p's top-p (after top-k) by a sort of every row's whole vocabulary:
    the reference, and what runs where the candidates cannot answer."""
    vocab = logits.size(1)
    ascending, order = logits.sort(dim=-1)                      # [R, V]
    if top_k is not None:
        kth = ascending.gather(1, (vocab - top_k).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth, _NEG_INF)
    # mass of tokens at or below each position == 1 - mass strictly above it
    mass_at_or_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_at_or_below <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ascending)


SAMPLE_BLOCK = 128         # tokens per block of sample_categorical's two-level search


def sample_categorical(probs: torch.Tensor, generators: Mapping[int, torch.Generator],
                       block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """One token per row, token i of row r with probability probs[r, i] / probs[r].sum()
    (rows need not be normalised; each needs positive mass): inverse-CDF sampling with ONE
    uniform per row. A seeded row draws it from its own generator, so its sample depends
    only on its own probabilities and its own seed; the other rows share the default RNG.
    The uniform is float64 (53 bits: a token far below fp32's 2^-24 keeps its share) and
    so are the prefix sums over blocks and within the picked block. Two levels, two passes
    over `probs`, no host sync: the blocks' masses (`block` tokens each) pick the block,
    the block's own prefix picks the token. One random number per row: drawing Exp(1)
    noise for every token instead (the exponential race) costs ~17 ns a token on a CPU
    core, 2.6 ms a row at a 152K vocab."""
    rows, dev = probs.size(0), probs.device
    u = torch.rand(rows, dtype=torch.float64, device=dev) if len(generators) < rows \
        else torch.empty(rows, dtype=torch.float64, device=dev)
    for row, gen in generators.items():          # one draw per seeded request
        u[row] = torch.rand(1, dtype=torch.float64, device=dev, generator=gen)[0]
    return inverse_cdf(probs, u, block)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = SAMPLE_BLOCK
                ) -> torch.Tensor:
    """Per row r, the first token whose prefix mass exceeds u[r] * the row's mass (u in
    [0, 1), float64): sample_categorical's pick."""
    rows, vocab = probs.shape
    dev = probs.device
    # block masses summed in the input's dtype (a float64 reduction costs 20x on a CPU; a
    # block's sum is a cascade of `block` terms, relative error ~1e-7), accumulated in float64
    full = vocab // block
    parts = []
    if full:
        parts.append(probs[:, :full * block].reshape(rows, full, block).sum(-1))
    if vocab % block:
        parts.append(probs[:, full * block:].sum(-1, keepdim=True))
    cum = torch.cat(parts, 1).to(torch.float64).cumsum_(1)                 # [R, blocks]
    target = (u * cum[:, -1]).unsqueeze(1)
    blk = torch.searchsorted(cum, target, right=True).clamp_(max=cum.size(1) - 1)
    before = torch.where(blk > 0, cum.gather(1, (blk - 1).clamp_(min=0)), 0.0)
    start = blk * block                                                    # [R, 1]
    idx = start + torch.arange(block, device=dev)
    vals = probs.gather(1, idx.clamp(max=vocab - 1)).to(torch.float64)
    vals = vals.masked_fill_(idx >= vocab, 0.0)
    j = torch.searchsorted(vals.cumsum(1), target - before, right=True)
    # The block's prefix, summed in another order than its mass, can end a rounding below
    # the draw: its last token with positive mass takes it (never a zero-mass token).
    last = (torch.arange(block, device=dev) * (vals > 0)).amax(1, keepdim=True)
    return (start + torch.minimum(j, last)).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
                    ) -> LogprobsTensors:
    """logprobs [R, V] (already log_softmax), token_ids [R] -> the chosen token + top N."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)           # [R, 1]
    chosen = logprobs.gather(1, token_ids)                       # [R, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1                  # [R]
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids, lps = torch.cat([token_ids, top_ids], 1), torch.cat([chosen, top_lp], 1)
    else:
        ids, lps = token_ids, chosen
    return LogprobsTensors(token_ids=ids, logprobs=lps, ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int
                            ) -> LogprobsTensors:
    """Prompt logprobs for a chunk: logits [T, V] at positions t predict target_ids[t] (the
    prompt token at t + 1; the caller aligns chunks). Raw, like the sampled logprobs."""
    if logits.dim() != 2 or target_ids.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V] and target_ids [T], got "
                         f"{tuple(logits.shape)} and {tuple(target_ids.shape)}")
    return gather_logprobs(logits.float().log_softmax(dim=-1), target_ids, num_logprobs)


def processed_logits(raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """raw [N, V] fp32 -> after the grammar mask, the stop mask and penalties (what greedy
    takes argmax of)."""
    x = raw
    if md.grammar is not None:
        x = md.grammar.apply(x)
    if md.bias is not None:
        x = x.index_put(md.bias[:2], md.bias[2], accumulate=True)
    if md.stop_mask_rows is not None:
        x = x.index_put((md.stop_mask_rows, md.stop_mask_cols),
                        torch.tensor(_NEG_INF, device=x.device))
    if md.penalties is not None:
        x = apply_penalties(x, md.penalties)
    return x


def target_probs(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """processed logits [N, V] -> the distribution random rows sample from [N, V]."""
    return _filtered(x, md, owned=False).softmax(dim=-1)


def target_weights(x: torch.Tensor, md: SamplingMetadata, owned: bool) -> torch.Tensor:
    """target_probs up to each row's normaliser (what sample_categorical needs): exp of the
    filtered logits less their row maximum, without softmax's division pass. owned: x may
    be overwritten (the caller made it and reads it no more): then no [N, V] copy either."""
    x = _filtered(x, md, owned)
    return x.sub_(x.amax(dim=-1, keepdim=True)).exp_()


def _filtered(x: torch.Tensor, md: SamplingMetadata, owned: bool) -> torch.Tensor:
    """Temperature, min_p, top-k / top-p on processed logits (a new tensor unless owned)."""
    assert md.temperature is not None
    t = md.temperature.unsqueeze(1)
    x = x.div_(t) if owned else x / t
    if md.min_p is not None:
        x = apply_min_p(x, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        x = apply_top_k_top_p(x, md.top_k, md.max_top_k, md.top_p)
    return x


def argmax_rows(x: torch.Tensor, cpu_op: bool = True) -> torch.Tensor:
    """x.argmax(dim=-1) of [N, V] fp32 logits; on the CPU the C++ op (kernels/csrc/norm.cpp,
    the same first-index / NaN-first semantics), which is ~10x faster than torch's reduction
    at decode sizes (docs/cpu_kernels.md, "Norms and greedy argmax"). cpu_op: False always
    takes torch's (KernelConfig.cpu_argmax; A/B runs)."""
    if (cpu_op and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.size(1) > 0 and cpu_ops_available()):
        return torch.ops.wideserve.argmax_rows(x)
    return x.argmax(dim=-1)


class Sampler:
    """Stateless; every per-request input travels in SamplingMetadata. cpu_argmax: greedy
    rows by the C++ argmax op on the CPU (KernelConfig.cpu_argmax)."""

    def __init__(self, cpu_argmax: bool = True) -> None:
        self.cpu_argmax = cpu_argmax

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.size(0) != md.num_reqs or logits.size(1) != md.vocab_size:
            raise ValueError(f"logits must be [{md.num_reqs}, {md.vocab_size}], "
                             f"got {tuple(logits.shape)}")
        raw = logits.float()
        x = processed_logits(raw, md)
        greedy = None if md.all_random else argmax_rows(x, self.cpu_argmax)
        if md.all_greedy:
            assert greedy is not None
            token_ids = greedy
        else:
            # x is ours to overwrite when made here (a cast or a processing copy of the
            # logits) and the raw logprobs will not read it
            owned = x.data_ptr() != logits.data_ptr() and \
                (x is not raw or md.max_num_logprobs is None)
            token_ids = sample_categorical(target_weights(x, md, owned), md.generators)
            if greedy is not None:
                token_ids = torch.where(md.greedy_mask, greedy, token_ids)
        lp = None
        if md.max_num_logprobs is not None:
            lp = gather_logprobs(raw.log_softmax(dim=-1), token_ids, md.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=lp)

