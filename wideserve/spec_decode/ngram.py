"""N-gram (prompt lookup) proposer: no model.

For a request whose token list ends with the n-gram g (n from prompt_lookup_max down to
prompt_lookup_min), find g's most recent earlier occurrence in the prompt + output and propose
the tokens that followed it. Most useful where outputs copy the context (code edits, quoting,
the repetition of small models).

Host cost: one int32 buffer per request, appended to as tokens arrive (no per-step copy of the
history), and a vectorised search whose candidates are positions holding the last token.
"""
from __future__ import annotations

import numpy as np

from wideserve.spec_decode.proposer import ProposeInput, Proposer


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (min_n <= n <= max_n) of `tokens` [N]; empty if none occurs."""
    n_tok = tokens.size
    if n_tok < 2 or k < 1:
        return tokens[:0]
    # `ends`: end positions e < N - 1 of earlier occurrences of the suffix n-gram, n = 1, 2...
    ends = np.nonzero(tokens[:n_tok - 1] == tokens[n_tok - 1])[0]
    best = ends if min_n <= 1 else None
    for n in range(1, max_n):
        ends = ends[ends >= n]                  # room for one more token on the left
        if ends.size == 0:
            break
        ends = ends[tokens[ends - n] == tokens[n_tok - 1 - n]]
        if ends.size == 0:
            break
        if n + 1 >= min_n:
            best = ends
    if best is None or best.size == 0:
        return tokens[:0]
    start = int(best[-1]) + 1
    return tokens[start:start + k]


class NgramProposer(Proposer):
    writes_kv = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # request id -> (buffer, length): the request's tokens so far.
        self._history: dict[str, tuple[np.ndarray, int]] = {}

    def _tokens(self, request, extra: list[int]) -> np.ndarray:
        rid = request.request_id
        # all_token_ids only grows (rejected drafts never enter it): copy what is new.
        buf, n = self._history.get(rid, (np.zeros(0, np.int32), 0))
        need = request.num_tokens + len(extra)
        if buf.size < need:
            grown = np.zeros(max(need, 2 * buf.size, 64), np.int32)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:request.num_tokens] = request.all_token_ids[n:]
        buf[request.num_tokens:need] = extra
        self._history[rid] = (buf, request.num_tokens)
        return buf[:need]

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inp.step_reqs]
        for i in np.nonzero(inp.num_drafts > 0)[0].tolist():
            toks = self._tokens(inp.requests[i], inp.sampled[i] or [])
            out[i] = find_continuation(toks, self.min_n, self.max_n,
                                       int(inp.num_drafts[i])).tolist()
        return out

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
