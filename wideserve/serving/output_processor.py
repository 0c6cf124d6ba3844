"""Front-end side of a request: detokenise, match stop strings, fan out n, keep metrics.

Used in-process by the offline LLM and by the server's API process. The engine core speaks
tokens only; this turns its EngineCoreOutputs into RequestOutputs (cumulative) and
CompletionDeltas (what is new since the previous step, for streaming).

Glossary: a *parent* is what the user asked for; with n > 1 it has n *children*, each a
separate engine-core request with id "{index}_{parent id}" (a single child keeps the parent's
id). A child whose stop string matched is finished here and must be aborted in the core.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from wideserve.types.messages import EngineCoreRequest, StepLogprobs, TokenLogprobs
from wideserve.types.multimodal import ImageInput
from wideserve.types.sched_output import EngineCoreOutput, RequestEventType
from wideserve.text.detokenizer import FinalDetokenizer, IncrementalDetokenizer, make_detokenizer
from wideserve.types.outputs import (CompletionOutput, PromptLogprobs, RequestMetrics,
                                     RequestOutput, make_logprobs_entry)
from wideserve.types.sampling_params import SamplingParams
from wideserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Child:
    index: int
    detok: IncrementalDetokenizer | FinalDetokenizer | None
    out: CompletionOutput
    delta: CompletionDelta | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: dict[str, _Child] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_unfinished: int = 0
    kv_transfer_params: dict[str, Any] | None = None   # a prefill instance's KV handle


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]         # parents that changed this step
    deltas: dict[str, list[CompletionDelta]]     # parent id -> what is new, per child
    reqs_to_abort: list[str]                     # child ids finished by a stop string
    # parent id -> why: an output that could not be applied failed its request (and only
    # it); the parent is forgotten and its children are in reqs_to_abort.
    failed: dict[str, str] = field(default_factory=dict)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, stream: bool = True) -> None:
        """stream=False (the offline LLM): a parent's RequestOutput is made only once it has
        finished, and no CompletionDeltas, so a step costs no per-request output objects;
        the finished outputs are the same."""
        self.tokenizer = tokenizer
        self.stream = stream
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}

    # ----------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    priority: int = 0, group_id: str | None = None,
                    images: list[ImageInput] | None = None) -> list[EngineCoreRequest]:
        """Register a request; returns the engine-core requests to submit (one per child).
        `group_id`: the client request it is part of (several prompts of one HTTP request);
        default its own id. Every child carries it, for fair admission across groups."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(request_id, prompt, list(prompt_token_ids), params,
                         RequestMetrics(arrival_time=arrival), num_unfinished=params.n)
        core_requests = []
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            # Children of a seeded request get distinct, reproducible seeds.
            child_params = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            parent.children[cid] = _Child(i, self._detokenizer(prompt_token_ids, params),
                                          CompletionOutput(index=i, text="", token_ids=[]))
            self._child_parent[cid] = request_id
            core_requests.append(EngineCoreRequest(cid, list(prompt_token_ids), child_params,
                                                   arrival, priority,
                                                   group_id=group_id or request_id,
                                                   images=images))
        self._parents[request_id] = parent
        return core_requests

    def _detokenizer(self, prompt_ids: list[int],
                     params: SamplingParams
                     ) -> IncrementalDetokenizer | FinalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return make_detokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                params.stop or (), params.include_stop_str_in_output,
                                params.min_tokens, streaming=self.stream)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a parent (e.g. the client went away); returns its children's core ids."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for cid in parent.children:
            self._child_parent.pop(cid, None)
        return list(parent.children)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ------------------------------------------------------------------------ outputs
    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float | None = None) -> ProcessedOutputs:
        now = time.monotonic() if now is None else now
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        failed: dict[str, str] = {}
        for out in outputs:
            pid = self._child_parent.get(out.request_id)
            if pid is None:
                continue            # aborted by the front end meanwhile
            parent = self._parents[pid]
            child = parent.children[out.request_id]
            if child.out.finished:
                continue            # finished here by a stop string; the core's echo
            try:
                if self._apply(parent, child, out, now):
                    to_abort.append(out.request_id)
            except Exception as e:  # noqa: BLE001 - fail this request, keep the others going
                logger.exception("output for request %r could not be processed", pid)
                failed[pid] = f"output processing failed: {type(e).__name__}: {e}"
                to_abort.extend(self.abort_request(pid))
                touched.pop(pid, None)
                continue
            if self.stream or not parent.num_unfinished:    # else: nothing to report yet
                touched[pid] = parent
        result = ProcessedOutputs([], {}, to_abort, failed)
        for pid, parent in touched.items():
            finished = parent.num_unfinished == 0
            if not (finished or self.stream):
                continue
            result.request_outputs.append(RequestOutput(
                pid, parent.prompt, parent.prompt_token_ids, parent.prompt_logprobs,
                [c.out for c in parent.children.values()], finished, parent.metrics,
                parent.kv_transfer_params))
            result.deltas[pid] = [c.delta for c in parent.children.values() if c.delta]
            for c in parent.children.values():
                c.delta = None
            if finished:
                self.abort_request(pid)
        return result

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput,
               now: float) -> bool:
        """Fold one core output into a child; True if a stop string finished it here."""
        # Runs once per request and step: the rare fields are tested before any work.
        m = parent.metrics
        if out.events:
            for ev in out.events:
                if ev.type is RequestEventType.SCHEDULED and m.first_scheduled_time is None:
                    m.first_scheduled_time = ev.timestamp
        if out.num_cached_tokens > m.num_cached_tokens:
            m.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params
        ids = list(out.new_token_ids)
        if ids:
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            m.num_generation_tokens += len(ids)
        lp = out.new_logprobs
        if lp is not None and not isinstance(lp, StepLogprobs):
            lp = None
        if lp is not None and lp.prompt is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None] + self._entries(
                lp.prompt, parent.params.prompt_logprobs or 0, len(lp.prompt))
        stop_str = None
        if child.detok is not None:
            before = len(child.detok.token_ids)
            stop_token = out.finish_reason is not None and (
                out.finish_reason == "stop" and out.stop_reason is None
                or isinstance(out.stop_reason, int))
            stop_str = child.detok.update(ids, stop_terminated=bool(ids) and stop_token)
            if stop_str is None and out.finish_reason is not None:
                stop_str = child.detok.finish()
            ids = child.detok.token_ids[before:]    # a stop string drops later tokens
        co = child.out
        co.token_ids.extend(ids)
        new_lps = None
        if lp is not None and lp.sampled is not None and parent.params.logprobs is not None:
            new_lps = self._entries(lp.sampled, parent.params.logprobs, len(ids))
            co.logprobs = (co.logprobs or []) + new_lps
            co.cumulative_logprob = (co.cumulative_logprob or 0.0) + sum(
                lp.sampled.logprobs[k][0] for k in range(len(ids)))
        if stop_str is not None:
            co.finish_reason, co.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            co.finish_reason, co.stop_reason = out.finish_reason, out.stop_reason
        if self.stream:
            delta_text = child.detok.get_next_delta() if child.detok is not None else ""
            child.delta = CompletionDelta(child.index, delta_text, ids, new_lps,
                                          co.finish_reason, co.stop_reason)
        if child.detok is not None and (self.stream or co.finished):
            co.text = child.detok.output_text
        if co.finished:
            parent.num_unfinished -= 1
            if parent.num_unfinished == 0:
                m.finished_time = now
        return stop_str is not None and out.finish_reason is None

    def _entries(self, t: TokenLogprobs, num: int, count: int) -> list:
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            decode = lambda tid: tok.decode([tid], skip_special_tokens=False)  # noqa: E731
        return [make_logprobs_entry(t.token_ids[k], t.logprobs[k], t.ranks[k], num, decode)
                for k in range(min(count, len(t)))]
