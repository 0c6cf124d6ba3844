"""Incremental detokenisation with stop strings, for one request's output.

Decoding uses the prefix/read offset technique (TGI, vLLM): the ids are decoded in a small
window [prefix_offset, end) and compared with the window [prefix_offset, read_offset) decoded
before; the difference is the new text. The window's left context makes decoders that look at
neighbours (a sentencepiece leading space, cleanup of " .") agree with a one-shot decode, and
the first window starts a few prompt tokens back so the first output token gets its context.
When the new text ends in U+FFFD the last token holds an incomplete UTF-8 sequence: nothing is
emitted until a later token completes it (or finish() flushes genuinely broken bytes).

    ids:   ... prompt tail | out0 out1 ... | pending (no text yet)
                ^prefix_offset       ^read_offset      ^len(ids)

Stop strings are searched only where new text can complete one: from len(stop) - 1 chars
before the new text. The earliest-ending match wins (as if the text arrived one character at a
time); the text is cut at its start (or after it with include_stop_str_in_output) and every
token after the one that completed it is ignored.

Speed: where the tokenizer allows it (`Tokenizer.decode_stream`: a tokenizers backend without
the Python-side space cleanup), each token's step runs in tokenizers' own `DecodeStream`, the
same prefix/read offset algorithm in Rust: one call per token instead of two Python decodes
(measured ~6 -> ~3 us per token on a byte-level BPE: ~0.2 ms of a 64-request decode step;
BENCHMARKS.md "Host path per decode step"). The Python offsets are kept in step with it,
so finish() and a fallback (the stream rejects a window whose text changed under it, or the
context's text ends in an incomplete character) continue from the same state on the Python
path.

Text storage: committed chunks in `_parts`, the last max_stop_len - 1 chars in `_tail` (the only
text a later stop match can reach), so a long output costs O(1) per token, never a re-join.
Streaming: get_next_delta() hands out new text but holds back the longest tail that is a proper
prefix of a stop string, so a stop string is never partially emitted.
"""
from __future__ import annotations

from collections.abc import Sequence

from wideserve.text.tokenizer import DecodeStep as _Stream
from wideserve.text.tokenizer import Tokenizer

# Prompt tokens decoded as left context for the first output token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        streaming: bool = True,
    ) -> None:
        """streaming=False: get_next_delta is never called (only output_text is read), so
        no committed text is kept for it."""
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        context = [int(t) for t in prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS):]]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None   # decode of [prefix, read), cached
        self._stream = self._open_stream(tokenizer, skip_special_tokens, context)
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        self._parts: list[str] = []             # committed text
        self._tail = ""                         # last <= _keep chars (+ the newest delta)
        self._len = 0                           # total chars of text
        self._sent = 0                          # chars handed out by get_next_delta
        self._unsent_parts: list[str] = []      # parts committed since the last delta
        self._streaming = streaming
        self.token_ids: list[int] = []          # output ids consumed (stops at a stop string)
        self.stop_reason: str | None = None     # the stop string that ended the output
        self.finished = False

    # ---- public ----------------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Consume new output tokens; return the stop string if one completed (then the
        request is finished and later tokens are ignored). stop_terminated: the last token is
        an EOS/stop token id: it ends the output and is not detokenised unless
        include_stop_str_in_output; finish() is implied."""
        if self.finished:
            return None
        last = len(new_token_ids) - 1
        decode_next, append = self._decode_next, self._append
        for j, token in enumerate(new_token_ids):
            token = int(token)
            self.token_ids.append(token)
            if stop_terminated and j == last and not self._include_stop:
                break
            delta = decode_next(token)
            if delta and append(delta):
                return self.stop_reason
        if stop_terminated:
            return self.finish()
        return None

    def finish(self) -> str | None:
        """The request ended (length, EOS, abort): flush text held back for incomplete bytes.
        Returns a stop string only if the flushed text completed one."""
        if self.finished:
            return None
        self.finished = True
        if self._read_offset < len(self._ids):
            new_text = self._decode(self._ids[self._prefix_offset:])
            delta = new_text[len(self._window_prefix_text()):]
            self._read_offset = len(self._ids)
            if delta and self._append(delta):
                return self.stop_reason
        return None

    @property
    def output_text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return (self._parts[0] if self._parts else "") + self._tail

    def get_next_delta(self) -> str:
        """New text since the last call, minus a possible partial stop string at the end
        (everything once finished)."""
        hold = 0 if self.finished or self._include_stop else self._partial_stop_len()
        end = self._len - hold
        if end <= self._sent:
            return ""
        pending = "".join(self._unsent_parts) + self._tail
        start = self._len - len(pending)
        out = pending[self._sent - start:end - start]
        self._unsent_parts = []
        self._sent = end
        return out

    # ---- decoding --------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._prefix_text

    def _open_stream(self, tokenizer: Tokenizer, skip_special: bool,
                     context: list[int]) -> _Stream | None:
        """The Rust stream primed with the context, where it computes what _decode_next does:
        its first window's prefix is the context's text, unless that ends in an incomplete
        character (then the stream would emit the context's text too)."""
        make = getattr(tokenizer, "decode_stream", None)
        stream = make(skip_special, context) if make is not None else None
        if stream is None or not context:
            return stream
        if self._window_prefix_text().endswith(_REPLACEMENT):
            return None
        return stream

    def _decode_next(self, token: int) -> str:
        self._ids.append(token)
        if self._stream is not None:
            try:
                text = self._stream.step(token)
            except Exception:  # noqa: BLE001 - e.g. InvalidPrefix: the Python path from here
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                self._prefix_text = None
                return text
        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""   # nothing new yet, or the last char is still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return new_text[len(prefix_text):]

    # ---- text and stop strings ---------------------------------------------------------------

    def _append(self, delta: str) -> bool:
        """Add text; True if a stop string completed (text already cut, request finished)."""
        if not self._stop:      # nothing to search or hold back: the text is committed
            self._len += len(delta)
            self._parts.append(delta)
            if self._streaming:
                self._unsent_parts.append(delta)
            return False
        old_len = self._len
        self._tail += delta
        self._len += len(delta)
        stopped = False
        if self._stop and len(self.token_ids) > self._min_tokens:
            stopped = self._check_stop(old_len)
        if len(self._tail) > self._keep:
            cut = len(self._tail) - self._keep
            head, self._tail = self._tail[:cut], self._tail[cut:]
            self._parts.append(head)
            if self._streaming:
                self._unsent_parts.append(head)
        return stopped

    def _check_stop(self, old_len: int) -> bool:
        tail_start = self._len - len(self._tail)
        best: tuple[int, int, str] | None = None       # (end, start, stop) in tail coordinates
        for s in self._stop:
            # a match must end inside the new text, so start no earlier than this
            idx = self._tail.find(s, max(old_len - len(s) + 1, tail_start) - tail_start)
            if idx >= 0 and (best is None or (idx + len(s), idx) < best[:2]):
                best = (idx + len(s), idx, s)
        if best is None:
            return False
        end, start, s = best
        self._tail = self._tail[:end if self._include_stop else start]
        self._len = tail_start + len(self._tail)
        self.stop_reason = s
        self.finished = True
        return True

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._tail)), best, -1):
                if self._tail.endswith(s[:n]):
                    best = n
                    break
        return best


class FinalDetokenizer:
    """The output's text decoded once, when the request finishes: for a consumer that reads
    only the finished text (the offline LLM: OutputProcessor(stream=False)) of a request
    without stop strings. The interface and the text are IncrementalDetokenizer's; a step
    costs appending the ids, not a decode per token (docs/host_path.md).

    Why the text is the same: the incremental windows start at character boundaries (a
    window advances only once its text does not end in an incomplete character), and a
    native decode (Tokenizer.decodes_natively) is consistent across such boundaries, so the
    deltas add up to decode(context + output) minus decode(context). Where that prefix is not
    the start of the whole decode (the context ends in half a character that the output
    completes), finish() runs the incremental detokeniser over the ids instead."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._context = [int(t) for t in
                         prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS):]]
        self._text = ""
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None     # never set: no stop strings here
        self.finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> None:
        """As IncrementalDetokenizer.update (stop_terminated: the last id ends the output and
        is not decoded unless include_stop_str_in_output). Returns None: no stop strings."""
        if self.finished:
            return None
        self.token_ids += new_token_ids
        if stop_terminated:
            self._decode_all(len(self.token_ids) - (not self._include_stop))
        return None

    def finish(self) -> None:
        if not self.finished:
            self._decode_all(len(self.token_ids))
        return None

    @property
    def output_text(self) -> str:
        return self._text

    def _decode_all(self, num_ids: int) -> None:
        self.finished = True
        ids = [int(t) for t in self.token_ids[:num_ids]]
        if not ids:
            return
        decode = self._tokenizer.decode
        head = decode(self._context, skip_special_tokens=self._skip_special) \
            if self._context else ""
        whole = decode(self._context + ids, skip_special_tokens=self._skip_special)
        if whole.startswith(head):
            self._text = whole[len(head):]
            return
        slow = IncrementalDetokenizer(self._tokenizer, self._context, self._skip_special,
                                      streaming=False)
        slow.update(ids)
        slow.finish()
        self._text = slow.output_text


def make_detokenizer(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                     skip_special_tokens: bool = True, stop: Sequence[str] = (),
                     include_stop_str_in_output: bool = False, min_tokens: int = 0,
                     streaming: bool = True) -> IncrementalDetokenizer | FinalDetokenizer:
    """FinalDetokenizer where only the finished text is read and nothing in between needs it
    (not streaming, no stop strings, a native decode); IncrementalDetokenizer otherwise."""
    if not streaming and not stop and getattr(tokenizer, "decodes_natively", False):
        return FinalDetokenizer(tokenizer, prompt_ids, skip_special_tokens,
                                include_stop_str_in_output)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, stop,
                                  include_stop_str_in_output, min_tokens, streaming)
