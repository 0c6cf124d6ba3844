"""Tokenizer: a `tokenizers.Tokenizer` plus what a model directory says around it.

Read from a Hugging Face model directory:
- tokenizer.json (required; the fast-tokenizer file: model, pre-tokenizer, decoder, added tokens)
- tokenizer_config.json: bos/eos/pad/unk tokens (plain strings or AddedToken dicts),
  add_bos_token/add_eos_token, chat_template (a string, or a list of {name, template}),
  clean_up_tokenization_spaces
- chat_template.jinja (takes priority over the config's template, like transformers)
- generation_config.json: eos_token_id (int or list), merged into eos_token_ids

BOS/EOS policy: tokenizer.json's post-processor decides, as in transformers 5; in addition,
add_bos_token/add_eos_token = true in the config guarantees the token when the post-processor
does not add it (transformers 4 and llama.cpp honour the flag; transformers 5 ignores it).

Chat templates render the way transformers renders them: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loopcontrols, a `{% generation %}` tag, `raise_exception`,
`strftime_now`, a non-escaping `tojson`, and the special tokens (bos_token, eos_token, ...) in
the context. Messages drop None-valued keys, and reasoning given as `thinking`/`reasoning` is
also exposed as `reasoning_content` (and vice versa), as transformers 5 does.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wideserve.text.chat_templates import default_for_vocab

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# tokenizers >= 0.21; None on older builds (the detokenizer's Python path then).
_DecodeStream = getattr(tokenizers.decoders, "DecodeStream", None)


class DecodeStep:
    """One request's tokenizers.decoders.DecodeStream bound to its backend: step(id) is the
    text the id completes (None: none yet), as IncrementalDetokenizer's window computes it."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: tokenizers.Tokenizer, stream: Any) -> None:
        self._backend, self._stream = backend, stream

    def step(self, token_id: int) -> str | None:
        text: str | None = self._stream.step(self._backend, token_id)
        return text
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an AddedToken dict, got {value!r}")


def _int_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where}: expected an int or a list of ints, got {value!r}")
    return list(values)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    serving only needs it to parse and render its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes (no path to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(source)


def _normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | dict[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.name = name
        self.special_tokens = {k: v for k, v in zip(
            _SPECIAL_NAMES, (bos_token, eos_token, pad_token, unk_token)) if v is not None}
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.unk_token_id = self._id_of(unk_token)
        self.chat_template = chat_template
        self._templates: dict[str, jinja2.Template] = {}
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_token_ids))
        # transformers 5 skips the cleanup for BPE models: it corrupts " ." etc.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe_special = backend.encode("a", add_special_tokens=True).ids
        pp_bos = len(probe_special) > len(probe_plain) and probe_special[0] == self.bos_token_id
        pp_eos = len(probe_special) > len(probe_plain) and probe_special[-1] == self.eos_token_id
        self._prepend_bos = add_bos_token and self.bos_token_id is not None and not pp_bos
        self._append_eos = add_eos_token and self.eos_token_id is not None and not pp_eos

    def __getstate__(self) -> dict[str, Any]:
        # Compiled templates do not pickle; a copy (a tokenisation worker) compiles its own.
        return {**self.__dict__, "_templates": {}}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a model directory, or from a .gguf file (see from_gguf)."""
        d = Path(path)
        if d.is_file() and d.suffix == ".gguf":
            return cls.from_gguf(d)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {d}: wideserve loads fast tokenizers only (convert a slow "
                f"one with transformers: AutoTokenizer.from_pretrained(...).save_pretrained)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error names no file
            raise ValueError(f"{tok_file}: cannot be loaded by tokenizers ({e})") from e
        cfg_file = d / "tokenizer_config.json"
        cfg = _read_json(cfg_file)
        clean_up = bool(cfg.get("clean_up_tokenization_spaces", False))
        specials = {k: _token_content(cfg.get(k), f"{cfg_file}: {k}") for k in _SPECIAL_NAMES}
        gen_file = d / "generation_config.json"
        extra_eos = _int_ids(_read_json(gen_file).get("eos_token_id"), f"{gen_file}: eos_token_id")
        return cls(backend, **specials,
                   add_bos_token=bool(cfg.get("add_bos_token", False)),
                   add_eos_token=bool(cfg.get("add_eos_token", False)),
                   chat_template=(cls._load_template(d, cfg, cfg_file)
                                  or default_for_vocab(backend.token_to_id)),
                   extra_eos_token_ids=extra_eos,
                   clean_up_tokenization_spaces=clean_up,
                   name=str(d))

    @staticmethod
    def _load_template(d: Path, cfg: Mapping[str, Any], cfg_file: Path
                       ) -> str | dict[str, str] | None:
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        tpl = cfg.get("chat_template")
        if tpl is None or isinstance(tpl, str):
            return tpl
        if isinstance(tpl, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys()
                                         for t in tpl):
            return {t["name"]: t["template"] for t in tpl}
        raise ValueError(f"{cfg_file}: chat_template must be a string or a list of "
                         f"{{name, template}} dicts")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | Any) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file (wideserve.worker.gguf_loader);
        `path` may also be an already opened gguf_loader.GGUFFile."""
        from wideserve.worker.gguf_loader import load_gguf_tokenizer

        data = load_gguf_tokenizer(os.fspath(path) if isinstance(path, os.PathLike) else path)
        backend = data.tokenizer

        def content(token_id: int | None) -> str | None:
            return None if token_id is None else backend.id_to_token(token_id)

        return cls(backend,
                   bos_token=content(data.bos_token_id),
                   eos_token=content(data.eos_token_id),
                   pad_token=content(getattr(data, "pad_token_id", None)),
                   unk_token=content(getattr(data, "unk_token_id", None)),
                   add_bos_token=bool(getattr(data, "add_bos_token", False)),
                   add_eos_token=bool(getattr(data, "add_eos_token", False)),
                   chat_template=data.chat_template,
                   name=str(getattr(path, "path", path)))

    # ---- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_specials(ids) if add_special_tokens else ids

    def _with_specials(self, ids: list[int]) -> list[int]:
        # Unconditional, as a post-processor would do it: "<s>hi" gets a BOS of its own too.
        if self._prepend_bos:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        if self._append_eos:
            ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True,
                    max_tokens: int | None = None) -> list[list[int] | int]:
        """encode() of each text through the backend's batch call, which releases the GIL.
        A text of more than `max_tokens` tokens gives its token count instead of its ids, so
        the ids of a 10M-token text are never built as Python objects."""
        extra = (int(self._prepend_bos) + int(self._append_eos)) if add_special_tokens else 0
        out: list[list[int] | int] = []
        for enc in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens):
            count = len(enc) + extra
            if max_tokens is not None and count > max_tokens:
                out.append(count)
            else:
                out.append(self._with_specials(enc.ids) if add_special_tokens else enc.ids)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (a model's padded vocab rows) decode to nothing."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    @property
    def decodes_natively(self) -> bool:
        """decode is the backend's own (no Python-side space cleanup), so a text decoded
        whole equals the same text decoded window by window where the windows start at
        character boundaries (detokenizer.FinalDetokenizer relies on it)."""
        return not self._clean_up

    def decode_stream(self, skip_special_tokens: bool, context: Sequence[int]
                      ) -> DecodeStep | None:
        """tokenizers' incremental decoder over `context` (wideserve/text/detokenizer.py), or None
        where it would not decode as `decode` does: the space cleanup runs in Python here."""
        if self._clean_up or _DecodeStream is None:
            return None
        try:
            stream = _DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except TypeError:      # a tokenizers release whose DecodeStream takes no prompt ids
            return None
        return DecodeStep(self.backend, stream)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

    @property
    def vocab_size(self) -> int:
        """Including added tokens (transformers' len(tokenizer)); a model's vocab may be larger."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids |= {i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id,
                            self.unk_token_id) if i is not None}
        return sorted(ids)

    # ---- chat ------------------------------------------------------------------------------

    def _template_source(self, tools: Any, chat_template: str | None) -> str:
        tpl = self.chat_template
        if isinstance(tpl, dict):
            if chat_template is not None and chat_template in tpl:
                return tpl[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in tpl:
                    return tpl["tool_use"]
                if "default" in tpl:
                    return tpl["default"]
                raise ValueError(f"tokenizer has several chat templates and none is 'default': "
                                 f"pass chat_template= one of {sorted(tpl)}")
        if chat_template is not None:
            return chat_template
        if tpl is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template (no chat_template in "
                             f"tokenizer_config.json and no chat_template.jinja)")
        return tpl

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt string. Extra kwargs reach the template (e.g. a
        model's `thinking=True`). The text usually already holds the BOS token, so encode it
        with add_special_tokens=False (see encode_chat)."""
        if not messages:
            raise ValueError("messages must not be empty")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be a list of JSON-schema dicts")
        source = self._template_source(tools, chat_template)
        template = self._templates.get(source)
        if template is None:
            template = self._templates[source] = compile_chat_template(source)
        context = {"documents": None, **self.special_tokens, **kwargs}
        return template.render(messages=_normalise_messages(messages), tools=tools,
                               add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (WordPiece-era detokenisation fix-ups)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
