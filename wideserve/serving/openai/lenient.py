"""Request models that accept what clients echo back, as vLLM and OpenAI do.

Agents append the server's own message objects to the next request (`messages.append(
response.choices[0].message)`), and the SDKs serialise every field those objects carry:
`refusal`, `annotations`, `audio`, `function_call: null`, `parsed`, `index` inside tool
calls, and so on. Refusing them (400) breaks every agent loop at its second turn. So:

* fields a model class lists in `_ECHOED` are known echoes without meaning here: dropped with
  a debug log;
* any other unknown field is accepted and dropped too (vLLM's OpenAIBaseModel does the same),
  with a warning logged once per field name and the names returned to the client in the
  response header `x-wideserve-ignored-fields` (see `ignored_header`), so a typo is visible
  without breaking clients that send newer OpenAI fields.
"""
from __future__ import annotations

import logging
import threading
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("wideserve.server")

IGNORED_HEADER = "x-wideserve-ignored-fields"
# A header line must stay small whatever a client sends: at most this many names, each cut.
_MAX_HEADER_NAMES = 16
_MAX_NAME_CHARS = 64


class _WarnOnce:
    """Field names already warned about (one warning per name per process, not one per
    request: a client that always sends a field would otherwise flood the log)."""

    def __init__(self, limit: int = 4096) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._limit = limit

    def first_time(self, name: str) -> bool:
        with self._lock:
            if name in self._seen or len(self._seen) >= self._limit:
                return False
            self._seen.add(name)
            return True


_WARNED = _WarnOnce()


class LenientModel(BaseModel):
    """A strict request model (types are checked) that keeps unknown keys aside instead of
    failing (pydantic's `extra="allow"`: collected in Rust, no Python call per object, which
    matters for a body of 100k messages); `ignored_fields` reads them (see the module
    docstring). Nothing reads the extras but that."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    # Fields clients echo that mean nothing to this server: dropped with a debug log only.
    _ECHOED: ClassVar[frozenset[str]] = frozenset()


_NESTED: dict[type, tuple[str, ...]] = {}


def _holds_models(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_models(arg) for arg in typing.get_args(annotation))


def _nested_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `cls` whose values can hold models (the only ones worth walking)."""
    names = _NESTED.get(cls)
    if names is None:
        names = _NESTED[cls] = tuple(name for name, info in cls.model_fields.items()
                                     if _holds_models(info.annotation))
    return names


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Every unknown field of `model` and of the lenient models inside it, as dotted paths
    (`messages.2.mood`); the known echoes only debug-logged."""
    extra = model.__pydantic_extra__
    out: list[str] = []
    if extra:
        echo_names = getattr(type(model), "_ECHOED", frozenset())
        echoed = [k for k in extra if k in echo_names]
        if echoed and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: echoed fields ignored: %s", type(model).__name__,
                         ", ".join(echoed))
        out = [prefix + name for name in extra if name not in echo_names]
    for name in _nested_fields(type(model)):
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += ignored_fields(item, f"{prefix}{name}.{i}.")
    return out


def warn_ignored(names: list[str]) -> None:
    """One warning per field name (list positions folded: messages.3.x counts as
    messages.*.x)."""
    for name in names:
        generic = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if _WARNED.first_time(generic):
            logger.warning("request field %r is not known to this server and was ignored "
                           "(further occurrences are not logged)", generic[:_MAX_NAME_CHARS])


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header naming the ignored fields (empty when none); names are clipped
    and printable ASCII only, so a hostile key cannot forge a header."""
    if not names:
        return {}
    clean = []
    for name in names[:_MAX_HEADER_NAMES]:
        safe = "".join(c if c.isascii() and c.isprintable() and c != "," else "?"
                       for c in name[:_MAX_NAME_CHARS])
        clean.append(safe)
    if len(names) > _MAX_HEADER_NAMES:
        clean.append(f"... ({len(names)} in all)")
    return {IGNORED_HEADER: ", ".join(clean)}


def note_ignored(model: BaseModel) -> dict[str, str]:
    """Log the request's ignored fields once each and return the response header naming
    them (what every route does with an accepted request)."""
    names = ignored_fields(model)
    warn_ignored(names)
    return ignored_header(names)
