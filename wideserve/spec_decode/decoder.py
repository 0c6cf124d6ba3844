"""SpecDecoder: the engine core's speculative-decoding part (verify, count, propose).

Per step (EngineCore.step), with drafts scheduled as ordinary tokens by the scheduler:
  1. the target forward returns num_drafts + 1 logits rows per sampled request;
  2. `verify`: the rejection sampler turns them into accepted drafts + one token per
     request; `propose`: the proposer drafts the next k tokens (model proposers also write
     their KV for the step's verified positions), while every block is still held;
  3. the scheduler's update appends the tokens and rewinds rejected drafts
     (num_computed_tokens -= rejected);
  4. `commit`: the drafts of requests still running become request.spec_token_ids, which
     the next schedule() hands out (with lookahead slots reserved).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from wideserve.config import LoadConfig
from wideserve.types.messages import StepLogprobs, TokenLogprobs
from wideserve.types.sched_output import SchedulerOutput
from wideserve.worker.model_runner import ForwardOutput, ModelRunner, StepRequest
from wideserve.worker.penalties import PenaltyTracker
from wideserve.worker.sampler import build_sampling_metadata
from wideserve.models.interface import CausalLM
from wideserve.types.request import Request, RequestStatus
from wideserve.types.sampling_params import SamplingParams
from wideserve.config.speculative import SpeculativeConfig
from wideserve.spec_decode.acceptance_metrics import SpecDecodeStats
from wideserve.spec_decode.proposer import ProposeInput, Proposer
from wideserve.spec_decode.rejection_sampler import RejectionSampler, VerifyOutput
from wideserve.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger("wideserve.spec_decode")


# Builds a proposer: (config, target model, load config, vocab size, max model len).
ProposerFactory = Callable[[SpeculativeConfig, CausalLM, LoadConfig, int, int], Proposer]


def _mtp(config: SpeculativeConfig, model: CausalLM, load: LoadConfig, vocab_size: int,
         max_model_len: int) -> Proposer:
    from wideserve.spec_decode.mtp import MTPProposer
    return MTPProposer(model)


def _dspark(config: SpeculativeConfig, model: CausalLM, load: LoadConfig, vocab_size: int,
            max_model_len: int) -> Proposer:
    from wideserve.spec_decode.dspark import DSparkProposer
    return DSparkProposer(model, config.num_speculative_tokens,
                          config.dspark_confidence_threshold)


def _ngram(config: SpeculativeConfig, model: CausalLM, load: LoadConfig, vocab_size: int,
           max_model_len: int) -> Proposer:
    from wideserve.spec_decode.ngram import NgramProposer
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _draft_model(config: SpeculativeConfig, model: CausalLM, load: LoadConfig,
                 vocab_size: int, max_model_len: int) -> Proposer:
    from wideserve.spec_decode.draft_model import DraftModelProposer
    assert config.model is not None
    return DraftModelProposer(config.model, config.load_format, load, vocab_size,
                              max_model_len)


# speculative_config.method -> its proposer (the methods config/speculative.py accepts).
PROPOSERS: dict[str, ProposerFactory] = {
    "mtp": _mtp, "dspark": _dspark, "ngram": _ngram, "draft_model": _draft_model}


def make_proposer(config: SpeculativeConfig, model: CausalLM, load: LoadConfig,
                  vocab_size: int, max_model_len: int) -> Proposer:
    factory = PROPOSERS.get(config.method)
    if factory is None:
        raise ValueError(f"speculative_config.method {config.method!r} has no proposer; "
                         f"registered: {', '.join(sorted(PROPOSERS))}")
    return factory(config, model, load, vocab_size, max_model_len)


# Device type -> verified tokens per step beyond which drafts shrink (draft_depth). CPU: on
# the bundled model k = 2 pays 1.19-1.25x at batch 1-8 and every k costs at batch 64 (0.81-
# 0.96x; BENCHMARKS.md, "Speculative decoding"): 32 keeps k <= 3 to batch 8, k = 1 to 16 and
# none from 32. Other devices: not measured yet, so always k.
BATCH_TOKEN_BUDGET = {"cpu": 32}


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, model: torch.nn.Module, load: LoadConfig,
                 vocab_size: int, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.batch_token_budget = (config.batch_token_budget
                                   if config.batch_token_budget is not None else
                                   BATCH_TOKEN_BUDGET.get(torch.device(load.device).type, 0))
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config, model, load, vocab_size, max_model_len)
        self.sampler = RejectionSampler()
        self.stats = SpecDecodeStats(config.method, self.k, config.forced_acceptance_length)
        self._pending: dict[str, list[int]] = {}
        self._depth = self.k                    # drafts per request this step (draft_depth)
        self._credit: dict[str, float] = {}     # forced acceptance: drafts owed per request
        if config.is_forced:
            logger.warning(
                "SPECULATIVE DECODING WITH FORCED ACCEPTANCE LENGTH %.3g: drafts are accepted "
                "regardless of content; OUTPUTS ARE NOT THE MODEL'S. For benchmarks on "
                "synthetic prompts only.", config.forced_acceptance_length)

    @property
    def num_lookahead_tokens(self) -> int:
        return self.k if self.proposer.writes_kv else 0

    def kv_cache_specs(self, kv_cache_dtype: str) -> dict:
        return self.proposer.kv_cache_specs(kv_cache_dtype)

    def bind(self, runner: ModelRunner, kv_config, kv_caches) -> None:
        self.proposer.bind(runner, kv_config, kv_caches)

    def drop(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._credit.pop(rid, None)
            self._pending.pop(rid, None)
        self.proposer.drop(list(request_ids))

    # ------------------------------------------------------------------------- a step
    def verify(self, sched_out: SchedulerOutput, step_reqs: list[StepRequest],
               fwd: ForwardOutput, generators: Mapping[str, torch.Generator],
               eos_token_ids: Sequence[int], vocab_size: int,
               grammar: StructuredOutputManager | None = None,
               penalties: PenaltyTracker | None = None
               ) -> tuple[dict[str, list[int]], dict[str, StepLogprobs], ProposeInput]:
        """Tokens (accepted drafts + 1) and logprobs per sampled request, and what `propose`
        needs (call it before the scheduler's update, while every block is held). With
        structured outputs every row's target is masked by the grammar state after the
        drafts before it, so constrained speculation stays lossless. `penalties` (the
        engine's tracker) gives row j of a request its output counts plus drafts 0..j-1;
        without it they are rebuilt from the histories."""
        requests = [s.request for s in sched_out.scheduled]
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, StepLogprobs] = {}
        per_req: list[list[int] | None] = [None] * len(requests)
        num_valid = np.array([len(s.token_ids) for s in step_reqs], dtype=np.int64)
        if fwd.logits is not None:
            rows = fwd.sample_rows
            drafts = [sched_out.scheduled[i].spec_token_ids for i in rows]
            out = self._verify(fwd.logits, [requests[i] for i in rows], drafts, generators,
                               eos_token_ids, vocab_size, grammar, penalties)
            lp = out.logprobs.tolists() if out.logprobs is not None else None
            offset = 0
            for m, i in enumerate(rows):
                r, toks = requests[i], out.token_ids[m]
                sampled[r.request_id] = per_req[i] = toks
                num_valid[i] -= len(drafts[m]) - int(out.num_accepted[m])
                if lp is not None and r.sampling_params.logprobs is not None:
                    n, sl = r.sampling_params.logprobs + 1, slice(offset, offset + len(toks))
                    logprobs[r.request_id] = StepLogprobs(sampled=TokenLogprobs(
                        [x[:n] for x in lp[0][sl]], [x[:n] for x in lp[1][sl]], lp[2][sl]))
                offset += len(toks)
        assert fwd.batch is not None
        inp = ProposeInput(step_reqs, requests, fwd.batch, num_valid, per_req,
                           self._draft_caps(requests, per_req))
        return sampled, logprobs, inp

    @staticmethod
    def has_drafts(sched_out: SchedulerOutput) -> bool:
        """Whether the step verifies any draft. A step that does not is sampled by the plain
        sampler (EngineCore._sample: the same tokens as verifying zero drafts, without the
        rejection sampler's per-step work) and then hands `after_plain_step` its tokens."""
        return any(s.spec_token_ids for s in sched_out.scheduled)

    def after_plain_step(self, sched_out: SchedulerOutput, step_reqs: list[StepRequest],
                         fwd: ForwardOutput, sampled: Mapping[str, list[int]]
                         ) -> ProposeInput | None:
        """What `propose` needs after a step without drafts; None when the batch allows no
        drafts (draft_depth 0), so such a step costs what a non-speculative one does."""
        requests = [s.request for s in sched_out.scheduled]
        per_req = [sampled.get(r.request_id) for r in requests]
        caps = self._draft_caps(requests, per_req)
        if self._depth == 0:
            return None
        assert fwd.batch is not None
        num_valid = np.fromiter((len(s.token_ids) for s in step_reqs), dtype=np.int64,
                                count=len(step_reqs))
        return ProposeInput(step_reqs, requests, fwd.batch, num_valid, per_req, caps)

    def propose(self, inp: ProposeInput) -> None:
        if self._depth == 0:
            # The batch is too large for any draft (draft_depth): skip the proposer, whose
            # forward (MTP block, draft model catch-up) would cost ~15-20% of the step for
            # nothing. Its caches then miss these positions: drafts after the batch shrinks
            # are worse for up to a window's tokens, never wrong (verification is lossless).
            return
        for i, d in enumerate(self.proposer.propose(inp)):
            if d:
                self._pending[inp.requests[i].request_id] = d

    def commit(self, sched_out: SchedulerOutput) -> None:
        """After the scheduler's update: drafts for the requests still running."""
        for s in sched_out.scheduled:
            drafts = self._pending.pop(s.request_id, None)
            if drafts and s.request.status is RequestStatus.RUNNING:
                s.request.spec_token_ids = drafts

    # ------------------------------------------------------------------------ helpers
    def _verify(self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]],
                generators: Mapping[str, torch.Generator], eos_token_ids: Sequence[int],
                vocab_size: int, grammar: StructuredOutputManager | None = None,
                penalties: PenaltyTracker | None = None) -> VerifyOutput:
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        params: list[SamplingParams] = []
        outputs: list[list[int]] = []
        prompts: list[list[int]] = []
        gens: dict[int, torch.Generator] = {}
        rows: list[tuple[Request, list[int]]] = []
        for r, d in zip(reqs, drafts):
            sp, hist = r.sampling_params, r.output_token_ids
            # Row j sees the drafts before it as output (penalties, min_tokens); rows whose
            # params read neither keep the plain list (no copy). With the tracker the
            # penalties take the drafts as extra tokens, so only min_tokens needs a copy
            # (of an output shorter than min_tokens).
            exact = len(hist) < sp.min_tokens or (sp.has_penalties and penalties is None)
            g = generators.get(r.request_id)
            for j in range(len(d) + 1):
                if g is not None:
                    gens[len(params)] = g
                params.append(sp)
                outputs.append(hist + d[:j] if exact and j else hist)
                prompts.append(r.prompt_token_ids)
                rows.append((r, d[:j]))
        extra = {} if penalties is None else {"penalties": penalties.state(rows)}
        md = build_sampling_metadata(params, outputs, prompts, gens, logits.device, vocab_size,
                                     eos_token_ids=eos_token_ids, **extra)
        if grammar is not None:
            md.grammar = grammar.masks(reqs, drafts)
        forced = self._forced(reqs, num_drafts) if self.config.is_forced else None
        out = self.sampler(logits, md, num_drafts,
                           np.fromiter((t for d in drafts for t in d), dtype=np.int64,
                                       count=int(num_drafts.sum())), forced_accepted=forced)
        self.stats.observe(num_drafts, out.num_accepted)
        return out

    def _forced(self, reqs: list[Request], num_drafts: np.ndarray) -> np.ndarray:
        """Deterministic error diffusion: each request accepts AL - 1 drafts per verified
        step on average (capped by the drafts it had, with at most k owed)."""
        per_step = float(self.config.forced_acceptance_length) - 1.0   # type: ignore[arg-type]
        out = np.zeros(len(reqs), dtype=np.int64)
        for m, r in enumerate(reqs):
            k = int(num_drafts[m])
            if k == 0:
                continue
            credit = min(self._credit.get(r.request_id, 0.0) + per_step, float(self.k))
            out[m] = min(k, math.floor(credit + 1e-9))
            self._credit[r.request_id] = credit - out[m]
        return out

    def _draft_caps(self, requests: list[Request], emitted: list[list[int] | None]
                    ) -> np.ndarray:
        """Drafts wanted per request: k for the batch size (`draft_depth`), fewer near
        max_tokens / max_model_len (every draft and the bonus token must fit), 0 where
        nothing was emitted."""
        caps = np.zeros(len(requests), dtype=np.int64)
        k = self._depth = draft_depth(self.k, sum(1 for e in emitted if e),
                                      self.batch_token_budget)
        if k == 0:
            return caps
        for i, (r, e) in enumerate(zip(requests, emitted)):
            if not e:
                continue
            sp = r.sampling_params
            n_out, n_tok = r.num_output_tokens + len(e), r.num_tokens + len(e)
            left = self.max_model_len - n_tok - 1
            if sp.max_tokens is not None:
                left = min(left, sp.max_tokens - n_out - 1)
            caps[i] = max(0, min(k, left))
        return caps


def draft_depth(k: int, batch: int, budget: int) -> int:
    """Drafts per request for `batch` decoding requests: the largest k' <= k with
    batch * (k' + 1) <= budget (0 = no speculation); budget 0 always gives k."""
    if budget == 0 or batch == 0:
        return k
    return max(0, min(k, budget // batch - 1))
