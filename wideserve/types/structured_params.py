"""StructuredOutputsParams: what a request constrains its output to (vLLM's spelling).

Exactly one of json (a JSON Schema, as JSON text; generated compact unless its "x-guidance"
options say otherwise), json_object (any JSON object), regex,
choice (one of these strings) or grammar (Lark, llguidance's dialect; GBNF is converted).
It travels inside SamplingParams to the engine, which compiles it (see manager.py).
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_KINDS)} must be "
                             f"set, got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON 'top-level grammar' text)."""
        import llguidance
        m = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            if isinstance(schema, dict) and "x-guidance" not in schema:
                # JSON's own whitespace kept compact: a free-whitespace grammar lets a weak
                # model pad forever. A schema may ask otherwise through llguidance's options.
                schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
            return m.grammar_from_json_schema(json.dumps(schema))
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return m.grammar_from_lark(f"start: {alts}")
        assert self.grammar is not None
        from llguidance.gbnf_to_lark import any_to_lark   # GBNF (llama.cpp, xgrammar) or Lark
        return m.grammar_from_lark(any_to_lark(self.grammar))

    def digest(self) -> bytes:
        """SHA-256 of what the constraint is (kind and text): the key of the caches of
        validated and compiled grammars."""
        text = json.dumps([self.kind, self.json, self.regex, self.choice, self.grammar])
        return hashlib.sha256(text.encode()).digest()

    def error(self) -> str:
        """'' when the constraint compiles, else llguidance's message (checked by the server
        before the request reaches the engine, so a bad one is a 400)."""
        import llguidance
        try:
            return llguidance.LLMatcher.validate_grammar(self.to_grammar())
        # Broad on purpose: llguidance's GBNF converter raises GbnfToLarkError and also plain
        # Exception ("No 'root' rule found" for an empty grammar), and every failure to build
        # a constraint from the request's own text is the client's error, never a 500.
        except Exception as e:   # noqa: BLE001
            return str(e) or type(e).__name__


class _ErrorCache:
    """Validation results by constraint digest, least recently used out: agents resend the
    same tools and schemas with every turn, and validating a big one costs milliseconds to
    seconds. Keys are SHA-256 digests (32 bytes), not the constraint texts."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()          # front-end prep threads share it

    def get(self, params: StructuredOutputsParams) -> str:
        key = params.digest()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        error = params.error()
        with self._lock:
            self._entries[key] = error
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return error


_errors = _ErrorCache(512)


def cached_error(params: StructuredOutputsParams) -> str:
    """params.error(), remembered for the 512 constraints seen last."""
    return _errors.get(params)
