"""The scheduler: each step, which requests compute how many tokens.

Invariant (docs/design.md, "The one scheduling rule"). A request is a token list
(`all_token_ids` = prompt + output, plus `spec_token_ids` = drafts) and a count
`num_computed_tokens` of leading tokens whose KV is in the cache. There are no prefill and
decode phases: each step hands out up to `max_num_batched_tokens` tokens so that computed
catches up with the list, and every request gets

    min(num_tokens_with_spec - num_computed_tokens,      # what is left to compute
        budget left this step,
        long_prefill_token_threshold (if > 0),
        max_model_len - num_computed_tokens)             # positions stay < max_model_len

Chunked prefill, prefix-cache hits, resumption after preemption, draft verification and
KV that arrives from a prefill instance are all this one subtraction.

P/D disaggregation (with a KV connector, disagg/): a waiting request whose KV comes from a
prefill instance is admitted with slots for the arriving positions but computes nothing; it
waits outside both queues (WAITING_FOR_REMOTE_KV) until the connector reports the load,
then joins the running requests with num_computed_tokens = prompt - 1 (the last prompt token
is computed here for its logits). A failed load recomputes or fails per policy. A prefill
instance's finished request may keep its blocks under the connector's lease.

Order of a step
  1. `schedule()`
     a. `_schedule_running`: running requests in order. If the KV manager has no room
        (`allocate_slots` -> None), `_preempt` a victim (FCFS: the last running request;
        PRIORITY: the largest (priority, arrival)) and retry: preemption is recompute (free
        the blocks, num_computed_tokens = 0, drafts dropped, back to the front of the waiting
        queue). A request that fails while it is the only one holding KV first tries smaller
        chunks (sliding-window pages are needed for a whole chunk at once); if not even one
        token fits it finishes with "error" instead of looping forever.
     b. `_schedule_waiting`, only if nothing was preempted this step: admit from the head of
        the waiting queue (FCFS or PRIORITY) while the budget, `max_num_seqs`,
        `max_new_requests_per_step` and `max_prefill_tokens_while_decoding` allow and the KV
        manager has room, starting each request at its prefix-cache hit.
     c. `_update_after_schedule`: advance num_computed_tokens optimistically by each
        request's share and move the scheduled drafts into the output.
  2. The runner computes the scheduled tokens and samples for every request whose step
     reaches the end of its token list (a partial prefill chunk samples nothing).
  3. `update_from_output`: lower num_computed_tokens by rejected drafts, append sampled
     tokens (stopping at the first stop condition: engine/stop_check.py), free finished
     requests' blocks and return one `EngineCoreOutput` per request with news.

One step is in flight at a time: every `schedule()` is followed by `update_from_output` with
its output (also when it is empty) before the next `schedule()`. Requests may be aborted or
finished between the two; their blocks are freed at once and their tokens are not appended.

Prefill while decoding: prompts admitted into a step with running requests get at most
`max_prefill_tokens_while_decoding` of it (0: all the budget left). A CPU step's time grows
with its tokens, so a burst admitted at once is one long step everybody waits out, and it then
finishes (and returns) in lock step; a slice per step answers sooner and de-synchronises it.

Prefill cap: `max_prefill_tokens` bounds the prompt tokens of one step, over the running
requests still in their prompt and the admitted ones (0: the budget). Past the point where a
step's weights stream in the time its arithmetic takes, a CPU step's time grows with its
tokens; a burst of prompts split over a few steps then returns most first tokens sooner for
little more total time (`wideserve serve` measures the cap at start: worker/prefill_cap.py).

Glossary: *computed* tokens have KV in the cache (for this request); *cached* tokens
(`num_cached_tokens`) are the part of the first admission that came from the prefix cache.
Every request gets exactly one output with a finish_reason, whoever ended it; requests ended
between steps (abort, front-end stop string, rejected input) report theirs from the next
`update_from_output`, so the engine loop should keep stepping while `has_requests()`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from wideserve.config import SchedulerConfig
from wideserve.engine.request_queue import RequestQueue, make_request_queue
from wideserve.engine.stop_check import FINISH_REASON, append_and_check_stop
from wideserve.types.sched_output import (EngineCoreOutput, RequestEvent, RequestEventType,
                                          ScheduledRequest, SchedulerOutput)
from wideserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from wideserve.kv_cache.kv_cache_manager import KVCacheManager
    from wideserve.disagg.scheduler_side import ConnectorScheduler

@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float                 # fraction of the KV pool in use
    num_preemptions: int            # since start
    num_errors: int                 # requests failed by the scheduler since start
    num_steps: int
    last_num_batched_tokens: int
    kv_stats: Any = None            # the KV manager's own stats (prefix-cache hits, ...)


def _prefilling(request: Request) -> bool:
    """Still computing its prompt (or a recompute): its tokens count against the prefill cap.
    A decode, with or without drafts, has one token of its list left to compute."""
    return request.num_tokens - request.num_computed_tokens > 1


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call has decided so far."""
    budget: int
    prefill_left: int        # prompt tokens this step may still take (the prefill cap)
    running: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def unschedule(self, request: Request) -> None:
        """Take back a running request's share (PRIORITY preempted it after scheduling it)."""
        for i, s in enumerate(self.running):
            if s.request is request:
                self.budget += s.num_new_tokens
                if _prefilling(request):        # its count is not advanced yet
                    self.prefill_left += s.num_new_tokens
                del self.running[i]
                return


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 eos_token_id_fallback: int | Iterable[int] | None = None,
                 kv_connector: ConnectorScheduler | None = None) -> None:
        """`eos_token_id_fallback`: the model's EOS id(s). A request stops (unless ignore_eos)
        on any of them and on its own `eos_token_id`; models with several EOS ids (e.g. an
        end-of-turn token besides end-of-text) pass them all."""
        # The KV manager keeps request.block_hashes current itself (it hashes newly full
        # blocks at lookup, allocation and free), so the scheduler never hashes.
        if config.max_num_batched_tokens < 1:
            raise ValueError("SchedulerConfig.max_num_batched_tokens must be >= 1")
        if config.max_num_seqs < 1:
            raise ValueError("SchedulerConfig.max_num_seqs must be >= 1")
        cap = config.max_prefill_tokens
        if cap != "auto" and (not isinstance(cap, int) or cap < 0):
            raise ValueError(f"SchedulerConfig.max_prefill_tokens must be >= 0 or 'auto', "
                             f"got {cap!r}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if min(config.long_prefill_token_threshold, config.max_new_requests_per_step,
               config.num_lookahead_tokens, config.max_prefill_tokens_while_decoding) < 0:
            raise ValueError("SchedulerConfig: long_prefill_token_threshold, "
                             "max_new_requests_per_step, num_lookahead_tokens and "
                             "max_prefill_tokens_while_decoding must be >= 0")
        if not (config.arrival_gap_ms >= 0 and config.arrival_wait_max_ms >= 0):
            raise ValueError("SchedulerConfig: arrival_gap_ms and arrival_wait_max_ms must "
                             "be >= 0")
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        if eos_token_id_fallback is None:
            self._model_eos: frozenset[int] = frozenset()
        elif isinstance(eos_token_id_fallback, int):
            self._model_eos = frozenset((eos_token_id_fallback,))
        else:
            self._model_eos = frozenset(eos_token_id_fallback)
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = make_request_queue(config.policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []          # for the next SchedulerOutput
        self._pending_outputs: list[EngineCoreOutput] = []  # ended between steps
        self._events: dict[str, list[RequestEvent]] = {}
        self._num_preemptions = 0
        self._num_errors = 0
        self._num_steps = 0
        self._last_num_batched_tokens = 0
        self._in_flight: SchedulerOutput | None = None
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind(kv_manager)

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in the scheduler")
        self.requests[rid] = request
        self._record(request, RequestEventType.QUEUED)
        problem = self._validate(request)
        if problem is not None:
            self._report_end(request, RequestStatus.FINISHED_ERROR, error=problem)
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _validate(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n == 0:
            return f"request {request.request_id!r}: prompt_token_ids is empty"
        if n >= self.max_model_len:
            return (f"request {request.request_id!r}: the prompt has {n} tokens, which leaves "
                    f"no room for output within max_model_len={self.max_model_len}")
        return None

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.finish_requests(request_ids, status)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> None:
        """End requests between steps (abort, or a stop string seen by the front end).

        Their blocks are freed at once; unknown or already finished ids are ignored (the
        request may have finished in the same step the front end decided to end it).
        """
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._end(request, status, stop_reason=stop_reason)

    # ----------------------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update_from_output() of the "
                               "previous step (pass every SchedulerOutput back, empty or not)")
        budget, cap = self.config.max_num_batched_tokens, self.config.max_prefill_tokens
        # "auto" before the engine has measured it: no cap yet.
        plan = _StepPlan(budget, min(budget, cap) if isinstance(cap, int) and cap else budget)
        if self.connector is not None:
            self._update_remote_loads()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self._update_after_schedule(plan)
        return self._make_output(plan)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        n = request.num_tokens_with_spec - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return max(0, min(n, budget, self.max_model_len - num_computed))

    def _schedule_running(self, plan: _StepPlan) -> None:
        # One pass per step over every running request; the common case (a decode step:
        # the tables already have room) takes the KV manager's allocation-free check and
        # one ScheduledRequest (docs/host_path.md).
        lookahead = self.config.num_lookahead_tokens
        has_room, write_start = self.kv.has_room, self.kv.kv_write_start
        running = RequestStatus.RUNNING
        # A snapshot: preemption removes requests from self.running while we walk it.
        for request in list(self.running):
            if plan.budget <= 0:
                return
            if request.status is not running:
                continue    # preempted (or failed) earlier in this pass
            n = self._num_new_tokens(request, request.num_computed_tokens, plan.budget)
            prefilling = _prefilling(request)
            if prefilling:
                n = min(n, plan.prefill_left)
            if n == 0:
                continue
            if not has_room(request, n, lookahead):
                n = self._allocate_running(request, n, plan)
                if request.status is not running:
                    continue
            plan.running.append(ScheduledRequest(request, n, False,
                                                 write_start(request.request_id)))
            plan.budget -= n
            if prefilling:
                plan.prefill_left -= n

    def _allocate_running(self, request: Request, n: int, plan: _StepPlan) -> int:
        """Slots for n more tokens of a running request, preempting others while there is
        no room; returns the share it gets (the request may end preempted or failed)."""
        lookahead = self.config.num_lookahead_tokens
        while self.kv.allocate_slots(request, n, num_lookahead_tokens=lookahead) is None:
            if len(self.running) == 1:
                return self._fit_alone(request, n)
            victim = self._pick_victim()
            plan.unschedule(victim)     # PRIORITY may pick one already scheduled
            self._preempt(victim, plan)
            if victim is request:
                break
        return n

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Ties (equal priority and arrival) go to the latest admitted, as in FCFS.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Preemption by recompute; the prefix cache usually recovers most of the work."""
        self._remove_running(request)
        request.spec_token_ids = []     # before free: uncomputed drafts must not be published
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend(request)
        plan.preempted.append(request.request_id)
        self._record(request, RequestEventType.PREEMPTED)

    def _fit_alone(self, request: Request, n: int, hit_blocks: Any = None,
                   num_hit: int = 0) -> int:
        """The request holds the only KV in use and `n` tokens do not fit. Sliding-window
        pages are needed for the whole chunk at once, so a smaller chunk may still fit: halve
        it until it does. Returns the share that fits, or 0 after failing the request."""
        lookahead = self.config.num_lookahead_tokens
        share = n
        while share > 1:
            share //= 2
            if self.kv.allocate_slots(request, share, hit_blocks, num_hit,
                                      num_lookahead_tokens=lookahead) is not None:
                return share
        positions = request.num_computed_tokens + num_hit + 1
        self._end(request, RequestStatus.FINISHED_ERROR, error=(
            f"request {request.request_id!r} does not fit in the KV cache even alone: "
            f"{positions} positions (+{lookahead} lookahead slots) need more blocks than the "
            f"pool has; use a larger KV cache or a smaller max_model_len / max_tokens"))
        return 0

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        cfg = self.config
        cap = cfg.max_new_requests_per_step
        prefill_left = min(plan.budget, plan.prefill_left)   # "Prefill cap", and
        if cfg.max_prefill_tokens_while_decoding and plan.running:   # "... while decoding"
            prefill_left = min(prefill_left, cfg.max_prefill_tokens_while_decoding)
        while self.waiting and prefill_left > 0 \
                and len(self.running) + self._num_held_by_connector() < cfg.max_num_seqs:
            if cap and len(plan.admitted) >= cap:
                return
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if self.connector is not None and self.connector.wants_load(request):
                started = self._start_remote_load(request, hit_blocks, num_hit)
                if started is None:
                    return          # the per-step load cap, or no room yet
                if started:
                    continue
                # Nothing to load (a full local hit): an ordinary admission.
            n = self._num_new_tokens(request, num_hit, prefill_left)
            if n == 0:
                return
            if self.kv.allocate_slots(request, n, hit_blocks, num_hit,
                                      num_lookahead_tokens=cfg.num_lookahead_tokens) is None:
                if self.running or self._num_held_by_connector():
                    return          # wait for running (or leased) requests to free blocks
                # Nothing else holds KV (cached blocks are evictable).
                n = self._fit_alone(request, n, hit_blocks, num_hit)
                if n == 0:
                    continue
            self.waiting.pop()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.admitted.append(self._scheduled(request, n, is_new_or_resumed=True))
            plan.budget -= n
            plan.prefill_left -= n
            prefill_left -= n
            self._record(request, RequestEventType.SCHEDULED)

    # ------------------------------------------------------------------ P/D remote KV
    def _num_loading(self) -> int:
        return self.connector.num_loading if self.connector is not None else 0

    def _num_held_by_connector(self) -> int:
        """Requests whose blocks the connector holds (loading, under a lease, or given-up
        loads in quarantine): they take sequence slots like running ones, since the pools
        are sized per sequence."""
        c = self.connector
        return c.num_loading + c.num_held + c.num_quarantined if c is not None else 0

    def _start_remote_load(self, request: Request, hit_blocks: Any, num_hit: int) -> bool | None:
        """Admit a request whose prompt KV comes from a prefill instance: slots for the
        arriving positions, no compute. True: started; False: nothing to load (admit it
        as usual); None: not this step (load cap, or no room while others hold KV)."""
        conn = self.connector
        assert conn is not None
        if not conn.can_start_load():
            return None
        if self.kv.mode == "replay":
            # A replay hit recomputes cached positions without rewriting their entries; the
            # pulled pages would overlap them, so a remote load starts from nothing.
            hit_blocks, num_hit = None, 0
        num_external = conn.num_external_tokens(request, num_hit)
        if num_external > 0 and self.kv.allocate_slots(
                request, 0, hit_blocks, num_hit, num_external_tokens=num_external) is None:
            if self.running or conn.num_loading:
                return None
            num_external = 0        # does not fit even alone: prefill it here in chunks
        if num_external <= 0:
            conn.skip_load(request)
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        conn.start_load(request, self.kv.block_ids(request.request_id), num_hit,
                        num_hit + num_external)
        self._record(request, RequestEventType.SCHEDULED)
        return True

    def _update_remote_loads(self) -> None:
        """Loads the connector finished since the last step: arrived KV counts as computed."""
        assert self.connector is not None
        loaded, failed = self.connector.take_finished_loads()
        for request, num_loaded in loaded:
            request.num_computed_tokens = num_loaded
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request, reason in failed:
            if self.connector.config.kv_load_failure_policy == "recompute":
                self.kv.free(request)       # nothing of the load was published
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.prepend(request)
            else:
                self._report_end(request, RequestStatus.FINISHED_ERROR, error=reason)

    def _scheduled(self, request: Request, n: int, is_new_or_resumed: bool) -> ScheduledRequest:
        return ScheduledRequest(request, n, is_new_or_resumed,
                                self.kv.kv_write_start(request.request_id))

    def _update_after_schedule(self, plan: _StepPlan) -> None:
        for s in (*plan.running, *plan.admitted):
            request = s.request
            if request.spec_token_ids:
                num_drafts = request.num_computed_tokens + s.num_new_tokens - request.num_tokens
                if num_drafts > 0:
                    s.spec_token_ids = request.spec_token_ids[:num_drafts]
                # The proposer sets fresh drafts after this step's tokens are known.
                request.spec_token_ids = []
            request.num_computed_tokens += s.num_new_tokens

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        scheduled = plan.running + plan.admitted
        out = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
            preempted_req_ids=plan.preempted,
            finished_req_ids=self._finished_ids,
            num_new_admitted=len(plan.admitted),
            kv_connector_meta=self.connector.build_meta() if self.connector else None)
        self._finished_ids = []
        self._num_steps += 1
        self._last_num_batched_tokens = out.num_batched_tokens
        self._in_flight = out
        return out

    # ------------------------------------------------------------------- after the forward
    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]],
                           logprobs: dict[str, Any] | None = None) -> list[EngineCoreOutput]:
        """`sampled`: request id -> tokens sampled this step (1, or accepted drafts + 1), for
        exactly the requests whose step reached the end of their token list."""
        if sched_out is not self._in_flight:
            raise RuntimeError("update_from_output() needs the output of the latest schedule()")
        self._in_flight = None
        outputs, self._pending_outputs = self._pending_outputs, []
        ended = False
        running, events = RequestStatus.RUNNING, self._events
        for s in sched_out.scheduled:
            request = s.request
            if request.status is not running and request.status.finished:
                continue    # ended between schedule() and now (abort): already reported
            new_ids = sampled.get(request.request_id, [])
            if s.spec_token_ids:
                self._rewind_rejected_drafts(request, s, len(new_ids))
            if request.num_computed_tokens < len(request.all_token_ids):
                if new_ids:
                    raise ValueError(f"request {request.request_id!r}: tokens were sampled for "
                                     f"a partial prefill chunk")
                continue
            if not new_ids:
                raise ValueError(f"request {request.request_id!r} reached the end of its tokens "
                                 f"but `sampled` has no token for it")
            out = append_and_check_stop(request, new_ids, self._model_eos, self.max_model_len)
            if logprobs is not None:
                out.new_logprobs = logprobs.get(request.request_id)
            if events:
                out.events = events.pop(request.request_id, None)
            if out.finish_reason is not None:
                out.kv_transfer_params = self._release(request)
                ended = True
            outputs.append(out)
        if ended:
            self.running = [r for r in self.running if not r.status.finished]
        return outputs

    def fail_step(self, sched_out: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """The step `sched_out` could not be executed: end every request it carried with
        `error` and undo what `schedule()` advanced, so the next step starts from a
        consistent state. Its KV was never (fully) written, so each request's computed count
        goes back to where the step began before its blocks are freed: only blocks computed
        by earlier, successful steps are published to the prefix cache. Returns the outputs
        the step owes (the failed requests' and any final outputs pending from before)."""
        if sched_out is not self._in_flight:
            raise RuntimeError("fail_step() needs the output of the latest schedule()")
        self._in_flight = None
        first_failed = len(self._pending_outputs)
        for s in sched_out.scheduled:
            request = s.request
            if request.status.finished:
                continue    # ended between schedule() and now: already reported
            request.num_computed_tokens -= s.num_new_tokens
            self._end(request, RequestStatus.FINISHED_ERROR, error=error)
        outputs, self._pending_outputs = self._pending_outputs, []
        for out in outputs[first_failed:]:
            out.internal_error = True
        return outputs

    def _rewind_rejected_drafts(self, request: Request, s: ScheduledRequest,
                                num_sampled: int) -> None:
        """Speculative-decoding hook: the sampler returns the accepted drafts plus one bonus
        token; the rejected drafts' slots are overwritten next step, so only the count drops."""
        num_drafts = len(s.spec_token_ids)
        num_rejected = num_drafts + 1 - num_sampled
        if not 0 <= num_rejected <= num_drafts:
            raise ValueError(f"request {request.request_id!r}: {num_sampled} tokens sampled for "
                             f"{num_drafts} drafts (expected 1..{num_drafts + 1})")
        request.num_computed_tokens -= num_rejected

    # ------------------------------------------------------------------------ bookkeeping
    def _end(self, request: Request, status: RequestStatus, *,
             stop_reason: int | str | None = None, error: str | None = None) -> None:
        """End a queued or running request outside update_from_output's stop checks."""
        if request.status is RequestStatus.RUNNING:
            self._remove_running(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            pass    # in no queue; the connector frees its blocks once the load has stopped
        else:   # WAITING or PREEMPTED: in the waiting queue
            self.waiting.remove(request)
        self._report_end(request, status, stop_reason=stop_reason, error=error)

    def _report_end(self, request: Request, status: RequestStatus, *,
                    stop_reason: int | str | None = None, error: str | None = None) -> None:
        """Finish a request that is in no queue; its final output goes out with the next
        update_from_output."""
        request.status = status
        request.stop_reason = stop_reason
        if status is RequestStatus.FINISHED_ERROR:
            self._num_errors += 1
        out = EngineCoreOutput(
            request.request_id, finish_reason=FINISH_REASON[status], stop_reason=stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=self._events.pop(request.request_id, None), error=error)
        self._pending_outputs.append(out)
        out.kv_transfer_params = self._release(request)

    def _release(self, request: Request) -> dict[str, Any] | None:
        """Free a finished request's blocks (or hand them to the connector: a prefill
        instance's lease, a load still stopping); returns its kv_transfer_params, if any."""
        request.spec_token_ids = []     # before free: uncomputed drafts must not be published
        params = None
        if self.connector is not None:
            params = self.connector.request_finished(request)
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        return params

    def _remove_running(self, request: Request) -> None:
        if self.running and self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)

    def _record(self, request: Request, kind: RequestEventType) -> None:
        self._events.setdefault(request.request_id, []).append(
            RequestEvent(kind, time.monotonic()))

    # -------------------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or self._num_loading() > 0

    def has_requests(self) -> bool:
        """Whether a step is still needed: unfinished requests, finished ids the runner has
        not seen, or final outputs not yet returned."""
        return self.has_unfinished_requests() or bool(self._finished_ids) \
            or bool(self._pending_outputs) \
            or (self.connector is not None and self.connector.has_pending())

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            kv_usage=self.kv.usage, num_preemptions=self._num_preemptions,
            num_errors=self._num_errors, num_steps=self._num_steps,
            last_num_batched_tokens=self._last_num_batched_tokens, kv_stats=self.kv.stats)
