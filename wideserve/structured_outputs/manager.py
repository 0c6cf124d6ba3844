"""The engine's structured-output state: grammars compiled off the step loop, one matcher
per constrained request, and the token masks of each step.

Life of a constrained request (see docs/structured_outputs.md):
  add     -> its grammar is compiled on a worker thread (several at once: llguidance drops
             the GIL while it builds one; a grammar compiled before is reused from a cache
             keyed by its digest); the request is held here, not in the scheduler, so it
             waits while every other request keeps running;
  ready   -> handed to the scheduler at the start of a step;
  a step  -> `masks` fills one bitmask row per logits row (with speculation, the state after
             each draft prefix: drafts are checked against the grammar, so a draft the
             grammar forbids is rejected like any other and speculation stays lossless);
             the sampler applies the mask to the whole batch at once; `accept` advances
             the matcher by the tokens the step emitted.
  failure -> a grammar that fails to compile, a matcher in an error state, a mask that allows
             no token (the constraint cannot be satisfied from here) or an emitted token the
             grammar refuses ends the request with an error (`take_failures`): it is never
             left to run unconstrained.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from wideserve.types.request import Request
from wideserve.worker.grammar_mask import GrammarMask, bitmask_width, fill_bitmask_row

logger = logging.getLogger(__name__)
# Compiled grammars kept for reuse (each request gets a deep copy of one).
GRAMMAR_CACHE_SIZE = 128


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str | Path, eos_token_ids: Sequence[int],
                 vocab_size: int, device: torch.device, workers: int | None = None) -> None:
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = device
        self.workers = workers or min(4, os.cpu_count() or 1)
        self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="wideserve-grammar")
        self._lltok: Any = None
        self._lltok_lock = threading.Lock()      # compile threads share one tokenizer
        # The first constrained request used to pay for llguidance's set-up (its imports and
        # the tokenizer's vocabulary) while other streams ran: done now, at start-up, on a
        # compile thread (a failure here is only logged; the first compile retries it).
        self.warm_up: cf.Future = self._pool.submit(self._warm_up)
        self._pending: dict[str, tuple[Request, cf.Future]] = {}
        self._compiled: OrderedDict[bytes, cf.Future] = OrderedDict()   # digest -> matcher
        self._cache_lock = threading.Lock()
        self._matchers: dict[str, Any] = {}
        self.failed: dict[str, str] = {}      # id -> why its constraint failed

    # ------------------------------------------------------------------ compilation
    def _warm_up(self) -> None:
        try:
            self._tokenizer()
        except Exception as e:  # noqa: BLE001 - an engine that never constrains still runs
            logger.debug("structured outputs not set up at start-up: %s", e)

    def _tokenizer(self) -> Any:
        """The llguidance tokenizer, built once (on the worker thread) from ours."""
        with self._lltok_lock:
            return self._build_tokenizer()

    def _build_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            from wideserve.text.tokenizer import Tokenizer
            tok = Tokenizer.from_pretrained(self.tokenizer_path)
            self._lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids or None)
        return self._lltok

    def _build(self, grammar: str) -> Any:
        import llguidance
        return llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)

    def _compiled_grammar(self, spec: Any) -> Any:
        """The compiled grammar of `spec`, built once for every request with the same
        constraint (the cache holds the last GRAMMAR_CACHE_SIZE; a thread asking for one
        another is building waits for it)."""
        key = spec.digest()
        with self._cache_lock:
            future = self._compiled.get(key)
            building = future is None
            if building:
                future = self._compiled[key] = cf.Future()
                while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        if building:
            try:
                future.set_result(self._build(spec.to_grammar()))
            except Exception as e:  # noqa: BLE001 - handed to every request waiting on it
                future.set_exception(e)
        return future.result()

    def _compile(self, request: Request) -> Any:
        """The request's own matcher (worker thread): a copy of the compiled grammar."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        compiled = self._compiled_grammar(spec)
        if compiled.is_error():
            raise ValueError(compiled.get_error())
        matcher = compiled.deep_copy()
        # A preempted-and-resumed or replayed request may already have output tokens.
        if request.output_token_ids and not matcher.consume_tokens(list(request.output_token_ids)):
            raise ValueError(matcher.get_error())
        return matcher

    def hold(self, request: Request) -> bool:
        """Take a constrained request (True) until its grammar is ready."""
        if request.sampling_params.structured_outputs is None:
            return False
        self._pending[request.request_id] = (request, self._pool.submit(self._compile, request))
        return True

    def ready(self, wait_s: float = 0.0) -> list[Request]:
        """Requests whose grammar is compiled, in arrival order (waiting up to wait_s for
        the first when asked: an engine with nothing else to do)."""
        if not self._pending:
            return []
        if wait_s > 0:
            cf.wait([f for _, f in self._pending.values()], timeout=wait_s,
                    return_when=cf.FIRST_COMPLETED)
        out = []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                self._matchers[rid] = future.result()
            except Exception as e:  # noqa: BLE001 - any failure ends only this request
                logger.error("request %s: grammar failed to compile: %s", rid, e)
                self.failed[rid] = f"the structured-output grammar failed to compile: {e}"
                continue
            out.append(request)
        return out

    def take_failures(self) -> dict[str, str]:
        """Requests whose constraint failed (id -> why) since the last call: each must end
        with an error, and a token sampled for it in this step must not be emitted."""
        failed, self.failed = self.failed, {}
        return failed

    def _fail(self, request_id: str, why: str) -> None:
        logger.error("request %s: %s", request_id, why)
        self._matchers.pop(request_id, None)
        self.failed.setdefault(request_id, why)

    @property
    def pending_ids(self) -> list[str]:
        """Requests held while their grammar compiles, or failed and not yet reported."""
        return [*self._pending, *self.failed]

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or bool(self.failed)

    def drop(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            entry = self._pending.pop(rid, None)
            if entry is not None:
                entry[1].cancel()
            self.failed.pop(rid, None)

    # ------------------------------------------------------------------------ a step
    def masks(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None
              ) -> GrammarMask | None:
        """One bitmask row per logits row: row r of request i (r = 0..len(drafts[i])) is the
        grammar state after its first r drafts. Rows past a draft the grammar refuses allow
        everything (the verifier rejects that draft, so they are never used)."""
        if not self._matchers:
            return None
        rows: list[int] = []
        width = bitmask_width(self.vocab_size)
        constrained = [(i, self._matchers.get(r.request_id)) for i, r in enumerate(requests)]
        n_rows = sum(1 + (len(drafts[i]) if drafts else 0)
                     for i, m in constrained if m is not None)
        if n_rows == 0:
            return None
        bitmask = torch.full((n_rows, width), -1, dtype=torch.int32)
        starts = _row_starts(len(requests), drafts)
        g = 0
        for i, matcher in constrained:
            if matcher is None:
                continue
            d = list(drafts[i]) if drafts else []
            valid = matcher.validate_tokens(d) if d else 0
            for j in range(valid + 1):
                fill_bitmask_row(matcher, bitmask, g + j)
                if j < valid:
                    matcher.consume_token(d[j])
            if valid:
                matcher.rollback(valid)
            self._check_rows(requests[i].request_id, matcher, bitmask, g, valid + 1)
            rows.extend(range(starts[i], starts[i] + len(d) + 1))
            g += len(d) + 1
        return GrammarMask(torch.tensor(rows, dtype=torch.int64, device=self.device),
                           bitmask.to(self.device))

    def _check_rows(self, request_id: str, matcher: Any, bitmask: torch.Tensor, first: int,
                    count: int) -> None:
        """A matcher in an error state, or a mask that allows no token at all, fails its
        request; its rows then allow everything (no row of -inf logits reaches the sampler)
        and the token sampled from them is dropped (take_failures)."""
        if matcher.is_error():
            why = f"the output constraint failed mid-decode ({_first_line(matcher)})"
        elif not matcher.is_stopped() and not bool(bitmask[first:first + count].any(dim=1).all()):
            why = ("the output constraint cannot be satisfied: no token can continue the "
                   "output from here")
        else:
            return
        bitmask[first:first + count] = -1
        self._fail(request_id, why)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Advance by the step's tokens. A grammar that has nothing left to match ends with
        EOS, which a stopped matcher does not consume. A token the grammar refuses fails
        the request (never left to continue unconstrained)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for t in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(t):
                self._fail(request_id, f"the output constraint failed mid-decode: token {t} "
                                       f"is not allowed ({_first_line(matcher)})")
                return


def _first_line(matcher: Any) -> str:
    """llguidance's error without the parser state it appends (which quotes the output)."""
    lines = matcher.get_error().strip().splitlines()
    return lines[0][:200] if lines else "unknown error"


def _row_starts(num: int, drafts: Sequence[Sequence[int]] | None) -> list[int]:
    if drafts is None:
        return list(range(num))
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    return starts
