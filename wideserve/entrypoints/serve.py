"""`wideserve serve [MODEL]`: the OpenAI-compatible server.

Flags are spelled like vLLM's wherever the concept is the same. A bad value is a one-line
argparse error naming the flag (exit 2); a model that fails to load is a one-line error
(exit 1). Heavy imports (fastapi, uvicorn, zmq) happen inside `run`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from wideserve.entrypoints.engine_args import (add_engine_args, add_request_limit_args,
                                               engine_config_from_args, one_line_error)
from wideserve.config.arg_types import (parse_bytes, parse_port, parse_positive_float,
                                        parse_positive_int)
from wideserve.serving.openai.response_store import add_response_store_args

# Request body limits, shared with `wideserve router` (the same door for clients).
MAX_REQUEST_BYTES = 64 * 2**20
BODY_READ_TIMEOUT_S = 60.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible server",
        description="Serve a model over an OpenAI-compatible HTTP API.")
    parser.error = one_line_error.__get__(parser)      # type: ignore[method-assign]
    add_engine_args(parser)
    # A server's bursts share steps: its prefill cap is measured (engine/scheduler.py).
    parser.set_defaults(max_prefill_tokens="auto")
    add_response_store_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=parse_port, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use; the first is reported (default: the model's "
                        "directory name, e.g. DeepSeek-V4-Flash)")
    g.add_argument("--api-key", default=os.environ.get("WIDESERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $WIDESERVE_API_KEY)")
    g.add_argument("--max-request-bytes", type=parse_bytes, default=MAX_REQUEST_BYTES,
                   help="largest accepted request body (413 beyond)")
    g.add_argument("--max-sequences-per-request", type=parse_positive_int, default=256,
                   help="most sequences one request may ask for: prompts x n (400 beyond)")
    g.add_argument("--header-read-timeout", type=parse_positive_float, default=30.0,
                   help="seconds a connection may take to send a request's headers before "
                        "it is closed (half-open and slowloris connections)")
    g.add_argument("--body-read-timeout", type=parse_positive_float,
                   default=BODY_READ_TIMEOUT_S,
                   help="seconds a request may take to send its body (408 after)")
    g.add_argument("--max-connections", type=parse_positive_int, default=4096,
                   help="open connections (and requests) at most; 503 beyond")
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="expose GET /debug/kv_integrity and /debug/stats")
    g.add_argument("--headless", action="store_true",
                   help="run this node's data-parallel ranks only, no API server (the "
                        "other nodes of a multi-node DEP deployment)")
    g.add_argument("--dp-prefix-affinity", action="store_true",
                   help="send prompts sharing a first block to the same data-parallel rank "
                        "when it is not much busier (see BENCHMARKS.md)")
    g.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="log verbosity (debug also logs each HTTP request)")
    add_chat_args(parser)
    add_engine_health_args(parser)
    add_request_limit_args(parser)
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _heartbeat_timeout(text: str) -> float:
    value = _seconds(text)
    if value <= 1.0:            # the engine's heartbeat interval (engine_proc --heartbeat-s)
        raise argparse.ArgumentTypeError(f"must exceed the 1 s heartbeat interval, got {text!r}")
    return value


def add_engine_health_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine health (docs/reliability.md)")
    g.add_argument("--engine-heartbeat-timeout", type=_heartbeat_timeout, default=10.0,
                   help="seconds without a heartbeat from the engine core (it sends one each "
                        "step, at least every second) before /health fails and new requests "
                        "get 503; it recovers if the engine speaks again (default 10)")
    g.add_argument("--engine-stall-timeout", type=_seconds, default=30.0,
                   help="seconds without a heartbeat before the engine is declared hung: it "
                        "is killed, open streams end with an error event, and the server "
                        "exits with code 1 (default 30; at least the heartbeat timeout)")


def _tool_parser_name(text: str) -> str:
    from wideserve.serving.openai.tool_parsers import get_tool_parser
    try:
        get_tool_parser(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return text


def _reasoning_parser_name(text: str) -> str:
    from wideserve.serving.openai.reasoning import get_reasoning_parser
    try:
        get_reasoning_parser(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return text


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("chat: templates, tool calling, reasoning (vLLM's flags)")
    g.add_argument("--chat-template", default=None,
                   help="a .jinja file or a builtin name (deepseek_v4) replacing the "
                        "tokenizer's template")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools on its own (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    g.add_argument("--tool-call-parser", type=_tool_parser_name, default=None,
                   help="the model's tool-call format: hermes, llama3_json, deepseek_v31, "
                        "deepseek_v32, deepseek_v4")
    g.add_argument("--reasoning-parser", type=_reasoning_parser_name, default=None,
                   help="split <think>...</think> into reasoning_content (deepseek_r1, "
                        "deepseek_v31, deepseek_v4, qwen3)")


def default_model_name(model: str | None) -> str:
    """The name clients send when --served-model-name is not given: the model directory's
    name ("DeepSeek-V4-Flash" for /models/DeepSeek-V4-Flash/), a .gguf file's stem, or the
    bundled model's name."""
    if model is None:
        return "shakespeare-v4-tiny"        # wideserve/assets/shakespeare-v4-tiny
    path = Path(model.rstrip("/\\") or model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or str(model)


def _check_kv_transfer(kv_transfer: Any) -> None:
    """Before anything starts: P/D over NIXL needs the [pd] extra and the shared secret."""
    from wideserve.utils.extras import require_kv_connector
    require_kv_connector(kv_transfer)
    if kv_transfer is not None and kv_transfer.kv_connector == "NixlConnector":
        kv_transfer.secret()        # a ValueError naming $WIDESERVE_KV_SECRET when missing


def run(args: argparse.Namespace) -> int:
    from wideserve.entrypoints.api_server import serve_forever
    if not args.served_model_name:
        args.served_model_name = [default_model_name(args.model)]
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("wideserve serve: error: --enable-auto-tool-choice requires --tool-call-parser",
              file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
        _check_kv_transfer(config.kv_transfer)
    except (ValueError, RuntimeError) as e:
        print(f"wideserve serve: error: {e}", file=sys.stderr)
        return 2
    if args.headless:
        from wideserve.serving.dp_launch import run_headless
        return run_headless(config)
    return serve_forever(args, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wideserve")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_parser(subparsers)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
