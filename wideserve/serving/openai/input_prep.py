"""Input processing that never stalls the event loop (docs/server_reliability.md).

Three defences, cheapest first:

1. O(1) rejection. No token of a BPE vocabulary covers more characters than its longest
   entry, so a text of more than `longest * max_model_len` characters cannot fit, whatever
   it tokenises to. A list of more token ids than max_model_len cannot fit either.
2. A pre-scan of large bodies with msgspec (20-30x faster than pydantic on a list of 7M ids
   or 700k messages), in the worker process, applies those bounds and the per-request
   sequence cap before pydantic builds a single object.
3. Tokenisation of long texts in a worker process. Measured against the tokenizers library's
   GIL-releasing batch encode in a thread (BENCHMARKS.md, "Input processing off the event
   loop"): both keep the loop responsive, but the thread grows the API process by the size of
   the Encoding (GBs for a 10M-token text, and glibc keeps much of it), while the worker keeps
   it flat and hands back only the count for a text that cannot fit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from wideserve.serving.openai.limits import RequestLimits, check_request_limits
from wideserve.utils.procs import die_with_parent, spawned_from_main_thread
from wideserve.text.tokenizer import Tokenizer

T = TypeVar("T")

# Shorter texts are tokenised inline: a worker round trip costs more than they do.
INLINE_CHARS = 16384
# Bodies from this size on are pre-scanned before pydantic parses them.
PRESCAN_BYTES = 256 << 10
# Normalisers that can shrink a text by at most 3x (NFC composes a Hangul L+V+T triple); any
# other (Strip, Replace, ...) could shrink it without bound, and then there is no bound.
_BOUNDED_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend"})


def _normalizer_ok(spec: Any) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_normalizer_ok(n) for n in spec.get("normalizers", []))
    return spec.get("type") in _BOUNDED_NORMALIZERS


def chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """The most characters one token can stand for, or None when there is no such bound
    (a model that fuses unknown characters into one token, a normaliser that deletes)."""
    backend = tokenizer.backend
    model = backend.model
    if type(model).__name__ != "BPE" or (getattr(model, "fuse_unk", False)
                                         and getattr(model, "unk_token", None)):
        return None
    spec = msgspec.json.decode(backend.to_str()).get("normalizer")
    if not _normalizer_ok(spec):
        return None
    # Byte-level vocabularies spell a token one character per byte, so this counts bytes,
    # never fewer than the characters the token covers.
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    return longest * (4 if spec else 1)


# The tokenizer of a worker process, set once by its initializer (one per process).
_worker_tokenizer: Tokenizer | None = None


def _worker_init(tokenizer: Tokenizer, parent_pid: int, pdeathsig: bool) -> None:
    global _worker_tokenizer
    die_with_parent(parent_pid, pdeathsig=pdeathsig)    # a SIGKILLed server leaves no worker
    _worker_tokenizer = tokenizer


def _worker_encode(texts: list[str], add_special_tokens: bool,
                   max_tokens: int) -> list[list[int] | int]:
    assert _worker_tokenizer is not None
    out = _worker_tokenizer.encode_many(texts, add_special_tokens, max_tokens)
    if sum(map(len, texts)) > (1 << 20):
        _trim_heap()
    return out


def _trim_heap() -> None:
    """Give a big Encoding's freed memory back to the OS (glibc keeps it otherwise)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class TokenizerPool:
    """Encodes texts: short ones inline, long ones in a worker process started on first use.
    Each result is the ids, or the token count when it exceeds `max_tokens`."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.workers = workers
        self.chars_bound = chars_per_token_bound(tokenizer)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def encode_many(self, texts: Sequence[str], add_special_tokens: bool,
                          max_tokens: int | None = None) -> list[list[int] | int]:
        """max_tokens: the bound past which only the count comes back (default: the
        context length; larger for a prompt that will be truncated)."""
        bound = self.max_tokens if max_tokens is None else max_tokens
        if sum(map(len, texts)) <= INLINE_CHARS:
            return self.tokenizer.encode_many(texts, add_special_tokens, bound)
        return await self._run(_worker_encode, list(texts), add_special_tokens, bound)

    async def prescan(self, body: bytes, limits: Limits) -> tuple[str, str, str | None] | None:
        """prescan() in the worker: even msgspec takes ~0.5 s over 700k messages."""
        return await self._run(prescan, body, limits)

    def start(self) -> None:
        """Start the worker now (blocking, ~0.5 s), not inside the first large request."""
        self._executor().submit(len, "").result()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork of a process with a running event loop and threads is unsafe.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.tokenizer, os.getpid(), spawned_from_main_thread()))
        return self._pool

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(), fn, *args)
        except concurrent.futures.process.BrokenProcessPool:
            self.close()                         # a new worker on the next call
            raise RuntimeError("the tokenisation worker died (out of memory?)") from None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # A worker deep in a 50 MB text would hold shutdown for tens of seconds: end it.
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------- pre-scan

class Limits(msgspec.Struct, frozen=True):
    max_model_len: int
    chars_bound: int | None          # characters per token at most (None: no bound)
    max_sequences: int               # prompts x n per request
    request: RequestLimits = msgspec.field(default_factory=RequestLimits)


def too_long_text(param: str, chars: int, limits: Limits) -> str | None:
    if limits.chars_bound is not None and chars > limits.chars_bound * limits.max_model_len:
        return (f"{param}: {chars} characters cannot fit in this model's maximum context "
                f"length of {limits.max_model_len} tokens (no token of this tokenizer spans "
                f"more than {limits.chars_bound} characters)")
    return None


def _too_many_ids(param: str, ids: list[Any], limits: Limits) -> str | None:
    if len(ids) > limits.max_model_len:
        return (f"{param}: {len(ids)} token ids cannot fit in this model's maximum context "
                f"length of {limits.max_model_len} tokens")
    return None


def prompt_overflow(prompt: Any, limits: Limits, param: str = "prompt") -> str | None:
    """Why a completions prompt (str, [str], [int], [[int]]) cannot fit, or None."""
    if isinstance(prompt, str):
        return too_long_text(param, len(prompt), limits)
    if not isinstance(prompt, list) or not prompt:
        return None
    if isinstance(prompt[0], str):
        return next((m for i, p in enumerate(prompt) if isinstance(p, str)
                     and (m := too_long_text(f"{param}.{i}", len(p), limits))), None)
    if isinstance(prompt[0], list):
        return next((m for i, p in enumerate(prompt) if isinstance(p, list)
                     and (m := _too_many_ids(f"{param}.{i}", p, limits))), None)
    return _too_many_ids(param, prompt, limits)


def _too_many_messages(count: int, limits: Limits) -> str:
    return (f"messages: {count} messages cannot fit in this model's maximum context length "
            f"of {limits.max_model_len} tokens")


def messages_overflow(messages: Any, limits: Limits) -> str | None:
    """Why a message list cannot fit: more messages than the context has tokens (every chat
    template we know renders at least a role marker per message), or more characters of
    string content than any rendering of them could fit."""
    if not isinstance(messages, list):
        return None
    if len(messages) > limits.max_model_len:
        return _too_many_messages(len(messages), limits)
    chars = sum(len(c) for m in messages if isinstance(m, dict)
                and isinstance(c := m.get("content"), str))
    return too_long_text("messages", chars, limits)


def sequences_overflow(num_prompts: int, n: Any, limits: Limits) -> str | None:
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    if num_prompts * n > limits.max_sequences:
        return (f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences exceeds "
                f"this server's limit of {limits.max_sequences} per request "
                f"(--max-sequences-per-request)")
    return None


def num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def prescan(body: bytes, limits: Limits, full: bool = True
            ) -> tuple[str, str, str | None] | None:
    """(code, message, param) when a body is certainly rejected, else None: first the request
    limits from the raw bytes (limits.py: no per-item objects), then, when `full` (a large
    body, in the worker), the context bounds over the decoded body. Malformed JSON is left to
    pydantic, which reports it in full."""
    exceeded = check_request_limits(body, limits.request)
    if exceeded is not None and exceeded.param == "messages" \
            and exceeded.count > limits.max_model_len:       # the deeper reason
        return "context_length_exceeded", _too_many_messages(exceeded.count, limits), "messages"
    if exceeded is not None:
        return exceeded.code, exceeded.message, exceeded.param
    if not full:
        return None
    # JSON builds no reference cycles, and a collection every 700 of 700k new dicts over a big
    # heap is what made this take seconds: no collector while decoding.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    finally:
        if gc_was_enabled:
            gc.enable()
    if not isinstance(data, dict):
        return None
    if data.get("truncate_prompt_tokens") is not None:
        return None        # a prompt too long for the context is cut, not refused (vLLM's)
    if "prompt" in data:
        why = prompt_overflow(data["prompt"], limits)
        if why is not None:
            return "context_length_exceeded", why, "prompt"
        why = sequences_overflow(num_prompts(data["prompt"]), data.get("n"), limits)
        if why is not None:
            return "too_many_sequences", why, "n"
    if "messages" in data:
        why = messages_overflow(data["messages"], limits)
        if why is not None:
            return "context_length_exceeded", why, "messages"
    if isinstance(data.get("tokens"), list):
        why = _too_many_ids("tokens", data["tokens"], limits)
        if why is not None:
            return "context_length_exceeded", why, "tokens"
    return None
