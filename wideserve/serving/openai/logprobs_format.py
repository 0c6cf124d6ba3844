"""Logprobs in OpenAI's shapes (completions' and chat's), and vLLM's `prompt_logprobs`.

`as_ids` is vLLM's `return_tokens_as_token_ids`: each token is shown as "token_id:{id}", so a
client can tell apart tokens that decode to the same text (or to no valid UTF-8 alone).
"""
from __future__ import annotations

from typing import Any

from wideserve.types.outputs import Logprob
from wideserve.text.tokenizer import Tokenizer

# JSON has no -inf: a token with zero probability is reported with this logprob (as vLLM does).
MIN_LOGPROB = -9999.0


def _clamp(lp: float) -> float:
    return lp if lp > MIN_LOGPROB else MIN_LOGPROB


def _token_text(tokenizer: Tokenizer, tid: int, lp: Logprob, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{tid}"
    return lp.decoded_token if lp.decoded_token is not None else \
        tokenizer.decode([tid], skip_special_tokens=False)


def _top(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda x: x[1].rank or 0)


def completion_logprobs(tokenizer: Tokenizer, entries: list[dict[int, Logprob]],
                        token_ids: list[int], num: int, text_offset: int,
                        as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset.
    top_logprobs holds the chosen token and the top `num` (as vLLM reports them)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        text = _token_text(tokenizer, tid, chosen, as_ids)
        tokens.append(text)
        token_lps.append(_clamp(chosen.logprob))
        top = {text: _clamp(chosen.logprob)}
        for t, lp in _top(entry, num):
            top.setdefault(_token_text(tokenizer, t, lp, as_ids), _clamp(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, entries: list[dict[int, Logprob]],
                  token_ids: list[int], num: int, as_ids: bool = False) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        text = _token_text(tokenizer, tid, chosen, as_ids)
        content.append({
            "token": text, "logprob": _clamp(chosen.logprob),
            "bytes": list(text.encode("utf-8", errors="replace")),
            "top_logprobs": [
                {"token": (tt := _token_text(tokenizer, t, lp, as_ids)),
                 "logprob": _clamp(lp.logprob),
                 "bytes": list(tt.encode("utf-8", errors="replace"))}
                for t, lp in _top(entry, num)],
        })
    return {"content": content}


def prompt_logprobs_json(tokenizer: Tokenizer, entries: Any) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} with the actual token and the top N."""
    if entries is None:
        return None
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                             "decoded_token": _token_text(tokenizer, t, lp)}
                    for t, lp in entry.items()})
    return out
