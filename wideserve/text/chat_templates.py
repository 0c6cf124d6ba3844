"""Chat templates wideserve ships, for tokenizers that come without one.

DeepSeek V4 checkpoints publish their conversation format as code rather than as a jinja
template; `deepseek_v4` is wideserve's template for it (thinking and non-thinking modes,
tools in DSML). A tokenizer without a template whose vocabulary has DeepSeek's role tokens
gets it automatically; `--chat-template` picks one by name or file explicitly.
"""
from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"
_DEEPSEEK_ROLE_TOKENS = ("<｜User｜>", "<｜Assistant｜>")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.jinja"))


def load_chat_template(spec: str) -> str:
    """A builtin template by name, or a .jinja file; a clear error names the flag."""
    path = _DIR / f"{spec}.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    file = Path(spec).expanduser()
    if file.is_file():
        return file.read_text(encoding="utf-8")
    raise ValueError(f"--chat-template: {spec!r} is neither a file nor a builtin template "
                     f"({', '.join(builtin_names())})")


def default_for_vocab(token_to_id) -> str | None:
    """The builtin template a template-less tokenizer should use, judged by its vocab."""
    if all(token_to_id(t) is not None for t in _DEEPSEEK_ROLE_TOKENS):
        return load_chat_template("deepseek_v4")
    return None
