"""The worker: owns a step's execution once the scheduler has decided it.

The engine core (engine/engine_core.py) schedules, emits outputs and keeps the requests'
lifecycle; it hands each step's `SchedulerOutput` to `Worker.execute`, which builds the
runner's step inputs, runs the forward (worker/model_runner.py), samples (or verifies and
proposes drafts, spec_decode/decoder.py) and returns the tokens per request. The line is
vLLM v1's and mini-sglang's: the scheduler decides, the worker owns inputs, forward and
sampling.

Per-request state the worker keeps (NOTE: only for requests the scheduler knows; every
finished or preempted request is dropped through `drop` at the start of the next step):
  generators        seeded requests' torch.Generator (SamplingParams.seed)
  prompt_logprobs   prompt logprobs gathered over a request's prefill chunks
  prompt_lp_sent    requests whose prompt logprobs went out with their first token
  penalties         per-request penalty counts (worker/penalties.py)
  runner.tables     block-table rows (worker/block_tables.py)
  spec              the speculative decoder's pending drafts (spec_decode/decoder.py)
  images            image requests' span embeddings until their prefill passes the images
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from wideserve.types.messages import StepLogprobs, TokenLogprobs
from wideserve.types.sched_output import ScheduledRequest, SchedulerOutput
from wideserve.engine.step_timer import StepTimer
from wideserve.worker.images import ImageEmbeddings
from wideserve.worker.model_runner import ModelRunner, StepRequest
from wideserve.worker.penalties import PenaltyTracker
from wideserve.worker.sampler import (Sampler, argmax_rows, build_sampling_metadata,
                                      compute_prompt_logprobs, make_generator, plain_greedy)
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams

if TYPE_CHECKING:       # both import the executor
    from wideserve.kv_cache.kv_cache_manager import KVCacheManager
    from wideserve.spec_decode.decoder import SpecDecoder
    from wideserve.structured_outputs.manager import StructuredOutputManager

# Prompt logprobs: fp32 logits made at most this many bytes at a time (rows = this / 4V).
PROMPT_LOGPROBS_SLICE_BYTES = 64 << 20

Sampled = dict[str, list[int]]


class Worker:
    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager,
                 structured: StructuredOutputManager, spec: SpecDecoder | None,
                 vocab_size: int, eos_token_ids: list[int], timer: StepTimer,
                 prompt_logprobs_slice_bytes: int = PROMPT_LOGPROBS_SLICE_BYTES,
                 cpu_argmax: bool = True) -> None:
        """kv_manager: read for each request's block-table rows and replay start; structured:
        the engine's grammar state (masks for sampling, accepted tokens); cpu_argmax:
        KernelConfig.cpu_argmax (greedy rows by the C++ argmax op on the CPU)."""
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.kv_manager = kv_manager
        self.structured = structured
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timer = timer
        self.prompt_logprobs_slice_bytes = prompt_logprobs_slice_bytes
        self.cpu_argmax = cpu_argmax
        self.sampler = Sampler(cpu_argmax)
        self.penalties = PenaltyTracker(vocab_size, self.device)   # counts kept per request
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs: dict[str, TokenLogprobs] = {}
        self.prompt_lp_sent: set[str] = set()
        self.prompt_tokens = 0          # prompt tokens computed (stats)
        self.images = ImageEmbeddings(self.model)   # image requests' span embeddings

    # ---------------------------------------------------------------------- requests
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        if params.seed is not None:
            self.generators[request_id] = make_generator(params.seed, self.device)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[request_id] = TokenLogprobs()

    def drop(self, finished: list[str] | set[str], preempted: list[str] | set[str]) -> None:
        """Forget finished requests' state, and the block-table rows of preempted ones."""
        for rid in finished:
            self.generators.pop(rid, None)
            self.prompt_logprobs.pop(rid, None)
            self.prompt_lp_sent.discard(rid)
        if self.images:
            self.images.drop(finished)
        self.penalties.drop(finished)
        if self.spec is not None and finished:
            self.spec.drop(finished)
        self.runner.drop(finished)
        self.runner.drop(preempted)

    def commit(self, sched_out: SchedulerOutput) -> None:
        """After the scheduler's update: drafts of running requests become their next
        step's spec tokens."""
        if self.spec is not None:
            self.spec.commit(sched_out)

    # -------------------------------------------------------------------------- step
    def execute(self, sched_out: SchedulerOutput
                ) -> tuple[Sampled, dict[str, StepLogprobs] | None]:
        timer = self.timer
        reqs = [self._step_request(s) for s in sched_out.scheduled]
        timer.mark("prepare")
        fwd = self.runner.forward(reqs)
        timer.mark("forward")
        sampled: Sampled = {}
        logprobs: dict[str, StepLogprobs] = {}
        propose = None
        spec = self.spec
        if spec is not None and spec.has_drafts(sched_out):
            sampled, logprobs, propose = spec.verify(
                sched_out, reqs, fwd, self.generators, self.eos_token_ids, self.vocab_size,
                grammar=self.structured, penalties=self.penalties)
        else:       # no drafts to verify (also with speculation): the plain sampler
            if fwd.logits is not None:
                rows = [sched_out.scheduled[i].request for i in fwd.sample_rows]
                sampled, logprobs = self._sample(rows, fwd.logits)
            if spec is not None:
                propose = spec.after_plain_step(sched_out, reqs, fwd, sampled)
        for rid, tokens in sampled.items():
            self.structured.accept(rid, tokens)
        for i, hidden in fwd.prompt_hidden.items():
            self._add_prompt_logprobs(reqs[i], sched_out.scheduled[i].request, hidden)
        for rid in sampled if self.prompt_logprobs else ():
            prompt_lp = self.prompt_logprobs.get(rid)
            if prompt_lp is not None and rid not in self.prompt_lp_sent:
                logprobs.setdefault(rid, StepLogprobs()).prompt = prompt_lp
                self.prompt_lp_sent.add(rid)
        timer.mark("sample")
        if propose is not None:
            assert spec is not None
            spec.propose(propose)      # draft model / MTP forwards count as forward time
            timer.mark("forward")
        return sampled, logprobs or None

    def _sample(self, rows: list[Request], logits: torch.Tensor
                ) -> tuple[Sampled, dict[str, StepLogprobs]]:
        """One token per row (no speculation): the requests whose tokens are all computed."""
        grammar = self.structured.masks(rows)
        if grammar is None and _all_plain_greedy(rows):
            # What the sampler would compute, without building its metadata.
            ids = argmax_rows(logits.float(), self.cpu_argmax).tolist()
            return {r.request_id: [t] for r, t in zip(rows, ids)}, {}
        gens = {k: self.generators[r.request_id] for k, r in enumerate(rows)
                if r.request_id in self.generators}
        md = build_sampling_metadata(
            [r.sampling_params for r in rows], [r.output_token_ids for r in rows],
            [r.prompt_token_ids for r in rows], gens, self.device, self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            penalties=self.penalties.state([(r, ()) for r in rows]))
        md.grammar = grammar
        out = self.sampler(logits, md)
        token_ids = out.token_ids.tolist()
        lp = out.logprobs.tolists() if out.logprobs is not None else None
        sampled: Sampled = {}
        logprobs: dict[str, StepLogprobs] = {}
        for k, r in enumerate(rows):
            sampled[r.request_id] = [token_ids[k]]
            if lp is not None and r.sampling_params.logprobs is not None:
                n = r.sampling_params.logprobs + 1
                logprobs[r.request_id] = StepLogprobs(sampled=TokenLogprobs(
                    [lp[0][k][:n]], [lp[1][k][:n]], [lp[2][k]]))
        return sampled, logprobs

    def _step_request(self, s: ScheduledRequest) -> StepRequest:
        # Runs once per scheduled request and step: plain list lengths, no properties.
        r = s.request
        rid = r.request_id
        end = r.num_computed_tokens
        start = end - s.num_new_tokens
        all_ids = r.all_token_ids
        num_tokens = len(all_ids)
        # Drafts follow the verified tokens; slice both so a step never copies the context.
        if end <= num_tokens:
            toks = all_ids[start:end]
        else:
            toks = all_ids[start:num_tokens] + \
                s.spec_token_ids[max(0, start - num_tokens):end - num_tokens]
        num_prompt = len(r.prompt_token_ids)
        if start < num_prompt:
            self.prompt_tokens += min(end, num_prompt) - start
        want_prompt = False
        if self.prompt_logprobs:
            lp = self.prompt_logprobs.get(rid)
            # Prompt logprobs only for positions not covered yet (a resumed request recomputes).
            want_prompt = lp is not None and len(lp) < num_prompt - 1 and end >= len(lp) + 1
        # A bounded replay ends once the step starts at or past kv_write_start: later steps
        # are plain ones (no write mask, no replay bookkeeping).
        write_start = s.kv_write_start if s.kv_write_start > start else 0
        return StepRequest(rid, toks, start, self.kv_manager.block_rows(rid),
                           write_start, end >= num_tokens, want_prompt,
                           len(s.spec_token_ids),
                           self.kv_manager.replay_start(rid) if write_start else 0,
                           s.is_new_or_resumed, all_ids,
                           self.images.for_step(r, start, end) if r.images else None)

    def _add_prompt_logprobs(self, step: StepRequest, request: Request,
                             hidden: torch.Tensor) -> None:
        """Row j predicts the token at position start + j + 1; keep the prompt's ones. Logits
        are made prompt_logprobs_slice_bytes of fp32 at a time: a 2,048-token chunk over a
        129k vocabulary would otherwise be a 1 GiB [chunk, vocab] tensor (plus its
        log_softmax)."""
        acc = self.prompt_logprobs[request.request_id]
        first = len(acc) + 1                       # next prompt position still without logprobs
        lo, hi = first - step.start - 1, request.num_prompt_tokens - step.start - 1
        lo, hi = max(lo, 0), min(hi, hidden.shape[0])
        if hi <= lo:
            return
        targets = torch.tensor(request.prompt_token_ids[step.start + lo + 1:step.start + hi + 1],
                               device=hidden.device)
        rows = max(1, self.prompt_logprobs_slice_bytes // (4 * self.vocab_size))
        k = request.sampling_params.prompt_logprobs
        for s in range(lo, hi, rows):
            e = min(s + rows, hi)
            logits = self.model.compute_logits(hidden[s:e])
            ids, lps, ranks = compute_prompt_logprobs(logits, targets[s - lo:e - lo], k).tolists()
            acc.extend(TokenLogprobs(ids, lps, ranks))


def _all_plain_greedy(rows: list[Request]) -> bool:
    """sampler.plain_greedy over the rows, each distinct SamplingParams checked once (the
    requests of one generate call share theirs) and min_tokens per row."""
    last = None
    for r in rows:
        p = r.sampling_params
        if p is not last:
            # min_tokens as the count: everything but the min_tokens test.
            if not plain_greedy((p,), (p.min_tokens,)):
                return False
            last = p
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            return False
    return True
