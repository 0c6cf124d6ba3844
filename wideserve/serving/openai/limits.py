"""What one request may ask for, checked on the raw JSON before any per-item object is built
(docs/server_reliability.md, "Request limits").

A request with 10,000 tool definitions, a 64 MB `anyOf` schema or a million `logit_bias`
entries costs seconds to parse, validate and compile whatever the answer is. These limits
reject such a request from the body's bytes: the top level is decoded into raw slices
(`msgspec.Raw`, nothing below them is built), sizes are the slices' lengths, counts come from
C-speed byte counts or a decode into raw items, and only a nested schema small enough to be
allowed is walked for its depth. This runs in the tokenisation worker for large bodies
(input_prep.prescan), inline for small ones, always before pydantic.

The defaults let every realistic client through (OpenAI's own caps are lower: 128 tools,
schema nesting 10, 4 stop strings) and are all settable with `wideserve serve` flags.
"""
from __future__ import annotations

from typing import Any

import msgspec

# Top-level fields holding an output constraint (a schema, regex, grammar or choice list),
# and the levels of JSON around the schema in each: response_format.json_schema.schema,
# structured_outputs.json, (Responses) text.format.schema.
_CONSTRAINT_FIELDS = {"response_format": 2, "structured_outputs": 1, "text": 2,
                      "guided_json": 0, "guided_regex": 0, "guided_choice": 0,
                      "guided_grammar": 0}
# Levels around a tool's `parameters` schema: [ {function: {parameters: ...}} ].
_TOOL_WRAPPING_DEPTH = 3


class RequestLimits(msgspec.Struct, frozen=True):
    """Per-request caps; each is a `wideserve serve` flag (engine_args.add_request_limit_args)."""
    max_tools: int = 512                  # --max-tools
    max_tools_bytes: int = 2 << 20        # --max-tools-bytes: all of `tools`, as JSON
    max_schema_bytes: int = 1 << 20       # --max-schema-bytes: one output constraint
    max_schema_depth: int = 64            # --max-schema-depth: JSON nesting of a schema
    max_logit_bias: int = 1024            # --max-logit-bias
    max_messages: int = 8192              # --max-messages (also Responses `input` items)
    max_stop: int = 16                    # --max-stop: stop strings
    max_stop_chars: int = 1024            # --max-stop-chars: characters of one stop string
    max_sequences: int = 256              # --max-sequences-per-request: prompts x n
    prep_timeout_s: float = 30.0          # --request-prep-timeout
    prep_workers: int = 4                 # --request-prep-workers
    max_header_bytes: int = 64 << 10      # --max-header-bytes: a request's head (431 beyond)
    log_request_content: bool = False     # --log-request-content (debug level only)


class LimitExceeded(msgspec.Struct, frozen=True):
    param: str
    message: str
    code: str = "request_limit_exceeded"
    count: int = 0                  # how many items, for a limit on a count


def _too_many(param: str, what: str, got: int, limit: int, flag: str) -> LimitExceeded:
    return LimitExceeded(param, f"{param}: {got} {what}; this server accepts at most "
                                f"{limit} ({flag})", count=got)


def _too_big(param: str, got: int, limit: int, flag: str) -> LimitExceeded:
    return LimitExceeded(param, f"{param}: {got} bytes of JSON exceeds this server's limit "
                                f"of {limit} bytes ({flag})")


def min_array_items(raw: bytes) -> int:
    """A lower bound on the elements of a JSON array from byte counts alone (a completions
    prompt): exact for a list of token-id lists; for a list of strings, half the unescaped
    quotes (a quote after an escaped backslash is miscounted as escaped, which only lowers
    the bound). 1 for anything else (one prompt)."""
    body = bytes(raw).strip()
    if not body.startswith(b"["):
        return 1
    inner = body[1:].lstrip()
    if inner.startswith(b"["):
        return body.count(b"[") - 1
    if inner.startswith(b'"'):
        return max(1, (body.count(b'"') - body.count(b'\\"')) // 2)
    return 1


def json_depth(value: Any, stop_at: int) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), walked without recursion; returns
    early once it passes `stop_at`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > stop_at:
                return deepest
        stack.extend((child, depth) for child in node if isinstance(child, (dict, list)))
    return deepest


def _decode(raw: msgspec.Raw, type_: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None                   # a wrong type: pydantic reports it in full


def _check_depth(param: str, raw: msgspec.Raw, extra: int,
                 limits: RequestLimits) -> LimitExceeded | None:
    if len(raw) <= 2 * (limits.max_schema_depth + extra):
        return None                   # too short to nest that deep
    value = _decode(raw, Any)
    if value is None:
        return None
    depth = json_depth(value, limits.max_schema_depth + extra) - extra
    if depth > limits.max_schema_depth:
        return LimitExceeded(param, f"{param}: nested {depth} levels deep, deeper than this "
                                    f"server's limit of {limits.max_schema_depth} "
                                    f"(--max-schema-depth)")
    return None


def _check_tools(raw: msgspec.Raw, limits: RequestLimits) -> LimitExceeded | None:
    if len(raw) > limits.max_tools_bytes:
        return _too_big("tools", len(raw), limits.max_tools_bytes, "--max-tools-bytes")
    items = _decode(raw, list[msgspec.Raw])
    if items is None:
        return None
    if len(items) > limits.max_tools:
        return _too_many("tools", "tools", len(items), limits.max_tools, "--max-tools")
    return _check_depth("tools", raw, _TOOL_WRAPPING_DEPTH, limits)


def _check_constraint(param: str, raw: msgspec.Raw,
                      limits: RequestLimits) -> LimitExceeded | None:
    if len(raw) > limits.max_schema_bytes:
        return _too_big(param, len(raw), limits.max_schema_bytes, "--max-schema-bytes")
    return _check_depth(param, raw, _CONSTRAINT_FIELDS[param], limits)


def _check_stop(raw: msgspec.Raw, limits: RequestLimits) -> LimitExceeded | None:
    stops = _decode(raw, str | list[msgspec.Raw] | None)
    if stops is None:
        return None
    if isinstance(stops, list):
        if len(stops) > limits.max_stop:
            return _too_many("stop", "stop strings", len(stops), limits.max_stop,
                             "--max-stop")
        stops = [s for s in (_decode(r, str) for r in stops) if s is not None]
    else:
        stops = [stops]
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_chars:
        return LimitExceeded("stop", f"stop: a stop string of {longest} characters exceeds "
                                     f"this server's limit of {limits.max_stop_chars} "
                                     f"(--max-stop-chars)")
    return None


def _check_sequences(top: dict[str, msgspec.Raw],
                     limits: RequestLimits) -> LimitExceeded | None:
    n = _decode(top["n"], Any) if "n" in top else 1
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompts = min_array_items(top["prompt"]) if "prompt" in top else 1
    if prompts * n > limits.max_sequences:
        return LimitExceeded("n", f"{prompts} prompt(s) x n={n} = {prompts * n} sequences "
                                  f"exceeds this server's limit of {limits.max_sequences} "
                                  f"per request (--max-sequences-per-request)",
                             "too_many_sequences")
    return None


def check_request_limits(body: bytes, limits: RequestLimits) -> LimitExceeded | None:
    """The first limit a request body exceeds, or None (also for malformed JSON and wrong
    types, which pydantic then reports)."""
    top = _decode(msgspec.Raw(body), dict[str, msgspec.Raw])
    if top is None:
        return None
    why = _check_sequences(top, limits)
    if why is None and "tools" in top:
        why = _check_tools(top["tools"], limits)
    for field in _CONSTRAINT_FIELDS:
        if why is None and field in top:
            why = _check_constraint(field, top[field], limits)
    if why is None and "stop" in top:
        why = _check_stop(top["stop"], limits)
    if why is None and "logit_bias" in top:
        entries = _decode(top["logit_bias"], dict[str, msgspec.Raw])
        if entries is not None and len(entries) > limits.max_logit_bias:
            why = _too_many("logit_bias", "entries", len(entries), limits.max_logit_bias,
                            "--max-logit-bias")
    for field in ("messages", "input"):
        if why is None and field in top:
            items = _decode(top[field], list[msgspec.Raw])
            if items is not None and len(items) > limits.max_messages:
                why = _too_many(field, "messages", len(items), limits.max_messages,
                                "--max-messages")
    return why


# RequestLimits field -> `wideserve serve` flag destination (engine_args.add_request_limit_args).
_FLAG_DESTS = {"max_sequences": "max_sequences_per_request",
               "prep_timeout_s": "request_prep_timeout", "prep_workers": "request_prep_workers"}


def request_limits_from_args(args: Any) -> RequestLimits:
    """The limits from parsed flags; a flag a caller does not define keeps its default."""
    values = {}
    for name in RequestLimits.__struct_fields__:
        value = getattr(args, _FLAG_DESTS.get(name, name), None)
        if value is not None:
            values[name] = value
    return RequestLimits(**values)
