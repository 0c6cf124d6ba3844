"""Input processing off the event loop: the characters-per-token bound, the worker pool, and
the pre-scan of large bodies (wideserve/serving/openai/input_prep.py)."""
from __future__ import annotations

import asyncio
import json
import pickle
import random
import time

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from oai_server_utils import write_tiny_model
from wideserve.serving.openai.input_prep import (INLINE_CHARS, Limits, TokenizerPool,
                                                 chars_per_token_bound, prescan)
from wideserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def _random_text(rng: random.Random, n: int) -> str:
    pieces = ["the ", "    ", "\n\n", "é", "🌍", "0123", "to be, or not", " ", "zz", "\t"]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_chars_bound_is_a_true_bound(tok):
    bound = chars_per_token_bound(tok)
    assert bound is not None and bound >= 2
    rng = random.Random(0)
    for _ in range(50):
        text = _random_text(rng, rng.randint(1, 400))
        assert len(tok.encode(text, False)) * bound >= len(text)
    # The longest token alone reaches the bound.
    longest = max(tok.backend.get_vocab(), key=len)
    assert len(longest) == bound


def test_no_chars_bound_where_none_exists():
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert chars_per_token_bound(Tokenizer(wordpiece)) is None       # a long word -> 1 [UNK]
    stripping = HFTokenizer(models.BPE({"a": 0, "b": 1}, []))
    stripping.normalizer = normalizers.Strip()                       # "   ...  a" -> "a"
    stripping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert chars_per_token_bound(Tokenizer(stripping)) is None
    nfkc = HFTokenizer(models.BPE({"a": 0, "ab": 1}, []))
    nfkc.normalizer = normalizers.NFKC()
    assert chars_per_token_bound(Tokenizer(nfkc)) == 8               # 2 chars x NFKC margin


def test_tokenizer_pickles_for_the_worker(tok):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])     # a compiled template
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode("to be or not", True) == tok.encode("to be or not", True)
    assert copy.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_encode_many_counts_instead_of_ids_past_the_limit(tok):
    texts = ["to be", "the quick brown fox " * 30]
    out = tok.encode_many(texts, True, max_tokens=10)
    assert out[0] == tok.encode("to be", True)
    assert out[1] == len(tok.encode(texts[1], True)) and isinstance(out[1], int)


def test_worker_pool_matches_inline_and_keeps_the_loop_free(tok):
    pool = TokenizerPool(tok, max_tokens=10**9)
    pool.start()
    try:
        fits = "to be, or not to be " * (INLINE_CHARS // 10)           # > INLINE_CHARS
        huge = "word " * 60_000

        async def main() -> tuple[list, list, float]:
            worst, stop = 0.0, asyncio.Event()

            async def ticker() -> None:
                nonlocal worst
                while not stop.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.005)
                    worst = max(worst, time.perf_counter() - t)

            tick = asyncio.create_task(ticker())
            a = await pool.encode_many([fits], True)
            pool.max_tokens = 1000
            b = await pool.encode_many([huge, fits[:100]], False)
            stop.set()
            await tick
            return a, b, worst

        t = time.perf_counter()
        inline_huge = len(tok.encode(huge, False))
        inline_time = time.perf_counter() - t
        a, b, worst = asyncio.run(main())
        assert a == [tok.encode(fits, True)]
        assert b == [inline_huge, tok.encode(fits[:100], False)]
        # The loop never waited anywhere near as long as tokenising inline blocks it.
        assert worst < max(0.25, inline_time / 3), (worst, inline_time)
    finally:
        pool.close()
    assert pool._pool is None


LIMITS = Limits(max_model_len=100, chars_bound=10, max_sequences=256)


@pytest.mark.parametrize("body,verdict", [
    ({"prompt": "x" * 1001}, "context_length_exceeded"),
    ({"prompt": "x" * 1000}, None),
    ({"prompt": ["a", "x" * 2000]}, "context_length_exceeded"),
    ({"prompt": list(range(101))}, "context_length_exceeded"),
    ({"prompt": [[1, 2], list(range(101))]}, "context_length_exceeded"),
    ({"prompt": list(range(100))}, None),
    ({"prompt": ["a"] * 3, "n": 100}, "too_many_sequences"),
    ({"prompt": ["a"] * 2, "n": 128}, None),
    ({"messages": [{"role": "user", "content": "w"}] * 101}, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "w" * 600}] * 2}, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "w"}] * 100}, None),
    ({"tokens": list(range(101))}, "context_length_exceeded"),
    ([1, 2, 3], None),                  # not an object: pydantic says so
])
def test_prescan(body, verdict):
    out = prescan(json.dumps(body).encode(), LIMITS)
    assert (out[0] if out else None) == verdict, out
    if out:
        assert out[1].split(":")[0] in ("prompt", "prompt.1", "messages", "tokens") \
            or "--max-sequences-per-request" in out[1]


def test_prescan_leaves_malformed_json_to_pydantic():
    assert prescan(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", LIMITS) is None
    assert prescan(b'{"prompt": "x', LIMITS) is None


def test_prescan_applies_the_request_limits_first_and_names_the_deeper_reason():
    from wideserve.serving.openai.limits import RequestLimits
    limits = Limits(max_model_len=100, chars_bound=10, max_sequences=256,
                    request=RequestLimits(max_messages=8, max_tools=2))
    too_many = prescan(json.dumps({"messages": [{"role": "user", "content": "w"}] * 9}).encode(),
                       limits)
    assert too_many[0] == "request_limit_exceeded" and "--max-messages" in too_many[1]
    cannot_fit = prescan(json.dumps({"messages": [{"role": "user", "content": "w"}] * 101})
                         .encode(), limits)
    assert cannot_fit[0] == "context_length_exceeded" and cannot_fit[2] == "messages"
    tools = prescan(json.dumps({"tools": [{}] * 3}).encode(), limits, False)
    assert tools == ("request_limit_exceeded",
                     "tools: 3 tools; this server accepts at most 2 (--max-tools)", "tools")
    # Prompts are counted from their bytes: 10 million token-id lists, or strings with quotes.
    body = b'{"prompt": [' + b",".join([b"[1]"] * 10_000_000) + b"]}"
    assert prescan(body, limits, False)[0] == "too_many_sequences"
    assert prescan(json.dumps({"prompt": ['a "q" b'] * 257}).encode(), limits, False)[0] \
        == "too_many_sequences"
    assert prescan(json.dumps({"prompt": ['a "q" b'] * 256}).encode(), limits, False) is None
