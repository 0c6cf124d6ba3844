"""Verification of draft tokens against the target's logits, in one batched pass.

Layout: request i verified k_i drafts d_i1..d_ik this step (k_i may be 0); the target computed
k_i + 1 logits rows for it, consecutive, row j predicting the token after d_ij (row 0: after
the request's last real token). Rows of all requests are stacked: N = sum(k_i + 1).

Target distribution p_j: the raw row -> min_tokens stop mask -> penalties (exactly the normal
Sampler's stages, with row j seeing output + d_i1..d_ij as its history, which the caller puts
in the SamplingMetadata) -> greedy: argmax; random: temperature -> min_p -> top-k/top-p ->
softmax.

Greedy requests accept drafts while d_ij == argmax p_(j-1); the first mismatch is replaced by
the argmax; if all k_i are accepted the argmax of the last row is the bonus token.
Random requests use standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection emit a token from
norm(max(p - q, 0)); if all are accepted, a bonus token from the last row's p. Each emitted
token is then distributed exactly as the target's. A proposer that gives no draft
distribution proposed deterministically (q = one-hot at d_j): acceptance is p(d_j) and the
residual is p without d_j, renormalised.

Randomness: a request with a seed draws k_i uniforms and then the one uniform of the final
token's inverse-CDF draw (sampler.sample_categorical) from its own generator, so its tokens
depend only on its logits, drafts and generator; other requests share the default RNG. With k_i = 0 this is exactly the
normal Sampler's draw.

Forced acceptance (benchmarks only): the caller gives the number of drafts to accept per
request; the verifier keeps that many whatever they are and appends the target's token at the
next row. Outputs are then NOT the target model's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wideserve.worker.sampler import (LogprobsTensors, SamplingMetadata, gather_logprobs,
                                      processed_logits, sample_categorical, target_probs)


@dataclass(slots=True)
class VerifyOutput:
    num_accepted: np.ndarray                 # [R] int64, accepted drafts per request
    token_ids: list[list[int]]               # per request: accepted drafts + one more token
    # One row per emitted token, requests in order (sum(num_accepted + 1) rows); None unless
    # the metadata asks for logprobs. Raw logprobs of the target, like the Sampler's.
    logprobs: LogprobsTensors | None


@dataclass(slots=True)
class _Layout:
    """Index arrays of one step (host numpy; built once)."""
    num_drafts: np.ndarray      # [R]
    row0: np.ndarray            # [R] first logits row of each request
    draft0: np.ndarray          # [R] index of each request's first draft in the flat drafts
    draft_rows: np.ndarray      # [D] logits row verifying each draft
    draft_req: np.ndarray       # [D] request of each draft
    draft_pos: np.ndarray       # [D] position j of each draft in its request

    @classmethod
    def build(cls, num_drafts: np.ndarray) -> _Layout:
        k = num_drafts.astype(np.int64)
        ends = np.cumsum(k + 1)
        row0 = ends - (k + 1)
        draft0 = np.cumsum(k) - k
        draft_req = np.repeat(np.arange(k.size, dtype=np.int64), k)
        draft_pos = np.arange(int(k.sum()), dtype=np.int64) - np.repeat(draft0, k)
        return cls(k, row0, draft0, row0[draft_req] + draft_pos, draft_req, draft_pos)


class RejectionSampler:
    """Stateless; every per-request input travels in SamplingMetadata (one row per logits
    row) and the draft arrays."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata, num_drafts: np.ndarray,
                 draft_token_ids: np.ndarray, draft_probs: torch.Tensor | None = None,
                 forced_accepted: np.ndarray | None = None) -> VerifyOutput:
        """logits [N, V]; num_drafts [R]; draft_token_ids [D] (flat, requests in order);
        draft_probs [D, V] (the draft distributions the drafts were sampled from) or None for
        deterministic drafts; forced_accepted [R] (benchmarks only) or None."""
        lay = _Layout.build(np.asarray(num_drafts, dtype=np.int64))
        n_rows, d = int((lay.num_drafts + 1).sum()), int(lay.num_drafts.sum())
        if logits.dim() != 2 or logits.size(0) != n_rows or md.num_reqs != n_rows:
            raise ValueError(f"logits must be [{n_rows}, V] (sum of num_drafts + 1) with one "
                             f"metadata row each; got {tuple(logits.shape)} and "
                             f"{md.num_reqs} rows")
        if draft_token_ids.shape != (d,):
            raise ValueError(f"draft_token_ids must be [{d}], got {draft_token_ids.shape}")
        if draft_probs is not None and tuple(draft_probs.shape) != (d, logits.size(1)):
            raise ValueError(f"draft_probs must be [{d}, {logits.size(1)}], got "
                             f"{tuple(draft_probs.shape)}")
        dev = logits.device
        raw = logits.float()
        x = processed_logits(raw, md)
        greedy = None if md.all_random else x.argmax(dim=-1)            # [N]
        probs = None if md.all_greedy else target_probs(x, md)           # [N, V]
        drafts = torch.from_numpy(draft_token_ids.astype(np.int64)).to(dev)
        rows = torch.from_numpy(lay.draft_rows).to(dev)
        gens = {i: md.generators[int(r)] for i, r in enumerate(lay.row0)
                if int(r) in md.generators}
        if forced_accepted is not None:
            accepted = np.minimum(np.asarray(forced_accepted, dtype=np.int64), lay.num_drafts)
        else:
            ok = self._accept(lay, md, greedy, probs, drafts, rows, draft_probs, gens)
            accepted = self._leading(lay, ok)
        sel = lay.row0 + accepted                                       # [R] final rows
        final = self._final_tokens(lay, md, greedy, probs, drafts, draft_probs, accepted,
                                   sel, gens, forced=forced_accepted is not None)
        draft_list = draft_token_ids.tolist()
        out = [draft_list[s:s + a] + [t] for s, a, t in
               zip(lay.draft0.tolist(), accepted.tolist(), final.tolist())]
        lp = None
        if md.max_num_logprobs is not None:
            counts = accepted + 1
            out_rows = np.repeat(sel - accepted, counts) + (
                np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
            toks = torch.tensor([t for o in out for t in o], dtype=torch.int64, device=dev)
            lp = gather_logprobs(raw[torch.from_numpy(out_rows).to(dev)].log_softmax(dim=-1),
                                 toks, md.max_num_logprobs)
        return VerifyOutput(accepted, out, lp)

    # ----------------------------------------------------------------------- stages
    @staticmethod
    def _accept(lay: _Layout, md: SamplingMetadata, greedy: torch.Tensor | None,
                probs: torch.Tensor | None, drafts: torch.Tensor, rows: torch.Tensor,
                draft_probs: torch.Tensor | None,
                gens: dict[int, torch.Generator]) -> torch.Tensor:
        """[D] bool: would each draft be accepted (ignoring earlier rejections)."""
        greedy_ok = None if greedy is None else greedy.index_select(0, rows) == drafts
        if probs is None:
            assert greedy_ok is not None
            return greedy_ok
        p = probs[rows, drafts]                                         # [D]
        q = draft_probs.gather(1, drafts[:, None]).squeeze(1) if draft_probs is not None \
            else torch.ones_like(p)
        u = torch.empty_like(p)
        if len(gens) < lay.num_drafts.size:
            u.uniform_()
        for i, g in gens.items():   # one draw per seeded request
            s, k = int(lay.draft0[i]), int(lay.num_drafts[i])
            if k:
                u[s:s + k] = torch.rand(k, generator=g, device=u.device, dtype=u.dtype)
        # u < p/q without dividing (q = 0 cannot come from a sampled draft; p = 0 rejects).
        random_ok = u * q < p
        if greedy_ok is None:
            return random_ok
        assert md.greedy_mask is not None
        return torch.where(md.greedy_mask.index_select(0, rows), greedy_ok, random_ok)

    @staticmethod
    def _leading(lay: _Layout, ok: torch.Tensor) -> np.ndarray:
        """Accepted drafts per request: the leading run of accepts."""
        r, kmax = lay.num_drafts.size, int(lay.num_drafts.max(initial=0))
        if kmax == 0:
            return np.zeros(r, dtype=np.int64)
        grid = torch.zeros(r, kmax, dtype=torch.int64, device=ok.device)
        grid[torch.from_numpy(lay.draft_req).to(ok.device),
             torch.from_numpy(lay.draft_pos).to(ok.device)] = ok.to(torch.int64)
        return grid.cumprod(dim=1).sum(dim=1).cpu().numpy()

    @staticmethod
    def _final_tokens(lay: _Layout, md: SamplingMetadata, greedy: torch.Tensor | None,
                      probs: torch.Tensor | None, drafts: torch.Tensor,
                      draft_probs: torch.Tensor | None, accepted: np.ndarray, sel: np.ndarray,
                      gens: dict[int, torch.Generator], forced: bool) -> torch.Tensor:
        """[R] the token after the accepted drafts: recovered (first rejection) or bonus."""
        dev = drafts.device
        sel_t = torch.from_numpy(sel).to(dev)
        greedy_final = None if greedy is None else greedy.index_select(0, sel_t)
        if probs is None:
            assert greedy_final is not None
            return greedy_final
        dist = probs.index_select(0, sel_t)                              # [R, V]
        rejected = np.nonzero(accepted < lay.num_drafts)[0] if not forced else \
            np.zeros(0, dtype=np.int64)
        if rejected.size:
            rej = torch.from_numpy(rejected).to(dev)
            which = torch.from_numpy(lay.draft0[rejected] + accepted[rejected]).to(dev)
            sub = dist.index_select(0, rej)
            if draft_probs is None:
                residual = sub.scatter(1, drafts.index_select(0, which)[:, None], 0.0)
            else:
                residual = (sub - draft_probs.index_select(0, which)).clamp_min_(0.0)
            mass = residual.sum(dim=1, keepdim=True)
            # p == q leaves no residual (and then rejection has probability 0): keep p.
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), sub)
            dist = dist.index_copy(0, rej, residual)
        final = sample_categorical(dist, gens)
        if greedy_final is not None:
            assert md.greedy_mask is not None
            final = torch.where(md.greedy_mask.index_select(0, sel_t), greedy_final, final)
        return final
