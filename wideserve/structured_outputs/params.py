"""StructuredOutputsParams: what a request constrains its output to (vLLM's spelling).

Exactly one of json (a JSON Schema, as JSON text; generated compact unless its "x-guidance"
options say otherwise), json_object (any JSON object), regex,
choice (one of these strings) or grammar (Lark, llguidance's dialect; GBNF is converted).
It travels inside SamplingParams to the engine, which compiles it (see manager.py).
"""
from __future__ import annotations

import json
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
