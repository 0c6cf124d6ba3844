"""`tools`, `tool_choice` and `parallel_tool_calls`: validated once per request, as OpenAI
and vLLM validate them (every mistake a 400 naming the field).

tool_choice (default "auto" when tools are given, else "none"):
  none      the model answers in text; tools are still shown to the template.
  auto      the model may call; the server's --tool-call-parser reads calls out of its text
            (400 unless the server runs with --enable-auto-tool-choice --tool-call-parser).
  required  / {"type": "function", "function": {"name": N}}: a call is guaranteed by
            constrained decoding (structured outputs), whatever the parser.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from wideserve.serving.openai.serving import ApiError

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CHOICE_HELP = ("must be 'none', 'auto', 'required' or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}")


@dataclass(slots=True)
class ToolSetup:
    tools: list[dict[str, Any]] | None       # as given (for the chat template)
    mode: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    def function(self, name: str) -> dict[str, Any]:
        for t in self.tools or []:
            if t["function"]["name"] == name:
                return t["function"]
        raise KeyError(name)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise _bad(param, "must be a JSON Schema object")
    from wideserve.worker.grammar_mask import schema_error
    error = schema_error(schema)
    if error:
        raise _bad(param, f"not a usable JSON Schema ({error})")


def check_tool_list(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", "must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object with a name")
        extra = set(tool) - {"type", "function"}
        if extra:
            raise _bad(where, f"unrecognized field {sorted(extra)[0]!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, "
                                                 "'_', '.' or '-'")
        if name in seen:
            raise _bad(f"{where}.function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"{where}.function.description", "must be a string")
        if not isinstance(fn.get("strict", False), bool):
            raise _bad(f"{where}.function.strict", "must be a boolean")
        if "parameters" in fn:
            _check_schema(fn["parameters"], f"{where}.function.parameters")


def resolve_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                  parallel_tool_calls: bool | None, auto_enabled: bool) -> ToolSetup:
    if tools is not None:
        check_tool_list(tools)
    names = {t["function"]["name"] for t in tools or []}
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"{tool_choice!r} is not valid; {_CHOICE_HELP}")
        if tool_choice == "required" and not tools:
            raise _bad("tool_choice", "'required' needs at least one tool in `tools`")
        if tool_choice == "auto" and tools and not auto_enabled:
            raise _bad("tool_choice", "\"auto\" tool choice requires the server to run with "
                                      "--enable-auto-tool-choice and --tool-call-parser")
        mode = tool_choice if tools else "none"
        return ToolSetup(tools, mode, None, parallel)        # type: ignore[arg-type]
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", _CHOICE_HELP)
    if fn["name"] not in names:
        raise _bad("tool_choice", f"names the function {fn['name']!r}, which is not in `tools`"
                   + (f" ({', '.join(sorted(names))})" if names else " (no tools given)"))
    return ToolSetup(tools, "named", fn["name"], parallel)
