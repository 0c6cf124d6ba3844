"""The engine's structured-output state: grammars compiled off the step loop, one matcher
per constrained request, and the token masks of each step.

Life of a constrained request (see docs/structured_outputs.md):
  add     -> its grammar is compiled on a worker thread; the request is held here, not in
             the scheduler, so it waits while every other request keeps running;
  ready   -> handed to the scheduler at the start of a step;
  a step  -> `masks` fills one bitmask row per logits row (with speculation, the state after
             each draft prefix: drafts are checked against the grammar, so a draft the
             grammar forbids is rejected like any other and speculation stays lossless);
             the sampler applies the mask to the whole batch at once; `accept` advances
             the matcher by the tokens the step emitted.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from wideserve.request import Request
from wideserve.structured_outputs.grammar import GrammarMask, bitmask_width

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str | Path, eos_token_ids: Sequence[int],
                 vocab_size: int, device: torch.device) -> None:
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = device
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lltok: Any = None
        self._pending: dict[str, tuple[Request, cf.Future]] = {}
        self._matchers: dict[str, Any] = {}
        self.failed: list[str] = []           # ids whose grammar failed to compile

    # ------------------------------------------------------------------ compilation
    def _tokenizer(self) -> Any:
        """The llguidance tokenizer, built once (on the worker thread) from ours."""
        if self._lltok is None:
            import llguidance

            from wideserve.tokenizer import Tokenizer
            tok = Tokenizer.from_pretrained(self.tokenizer_path)
            self._lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids or None)
        return self._lltok

    def _compile(self, request: Request) -> Any:
        import llguidance
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        matcher = llguidance.LLMatcher(self._tokenizer(), spec.to_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # A preempted-and-resumed or replayed request may already have output tokens.
        if request.output_token_ids and not matcher.consume_tokens(list(request.output_token_ids)):
            raise ValueError(matcher.get_error())
        return matcher

    def hold(self, request: Request) -> bool:
        """Take a constrained request (True) until its grammar is ready."""
        if request.sampling_params.structured_outputs is None:
            return False
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="wideserve-grammar")
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
                self.failed.append(rid)
                continue
            out.append(request)
        return out

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or bool(self.failed)

    def drop(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            entry = self._pending.pop(rid, None)
            if entry is not None:
                entry[1].cancel()

    # ------------------------------------------------------------------------ a step
    def masks(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None
              ) -> GrammarMask | None:
        """One bitmask row per logits row: row r of request i (r = 0..len(drafts[i])) is the
        grammar state after its first r drafts. Rows past a draft the grammar refuses allow
        everything (the verifier rejects that draft, so they are never used)."""
        if not self._matchers:
            return None
        import llguidance.torch as lt
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
                lt.fill_next_token_bitmask(matcher, bitmask, g + j)
                if j < valid:
                    matcher.consume_token(d[j])
            if valid:
                matcher.rollback(valid)
            rows.extend(range(starts[i], starts[i] + len(d) + 1))
            g += len(d) + 1
        return GrammarMask(torch.tensor(rows, dtype=torch.int64, device=self.device),
                           bitmask.to(self.device))

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Advance by the step's tokens. A grammar that has nothing left to match ends with
        EOS, which a stopped matcher does not consume."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for t in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(t):
                logger.warning("request %s: emitted a token the grammar refuses (%s); it is "
                               "no longer constrained", request_id, matcher.get_error()[:200])
                del self._matchers[request_id]
                return


def _row_starts(num: int, drafts: Sequence[Sequence[int]] | None) -> list[int]:
    if drafts is None:
        return list(range(num))
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    return starts
