"""`wideserve router --prefill URL... --decode URL...`: the P/D proxy (docs/disaggregation.md).

An OpenAI-compatible front door: each completion or chat request goes to a prefill instance
(one output token, `kv_transfer_params: {"do_remote_decode": true}`), then with the returned
KV handle to a decode instance, whose answer (streamed or not) goes back to the client.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from wideserve.entrypoints.engine_args import one_line_error
from wideserve.config.arg_types import parse_bytes, parse_port, parse_positive_float
from wideserve.entrypoints.serve import BODY_READ_TIMEOUT_S, MAX_REQUEST_BYTES


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL, got {text!r}")
    return text.rstrip("/")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router", help="proxy requests over prefill and decode instances (P/D)",
        description="Send each request's prompt to a prefill instance and its decode to a "
                    "decode instance, passing the KV handle between them.")
    parser.error = one_line_error.__get__(parser)      # type: ignore[method-assign]
    parser.add_argument("--prefill", nargs="+", type=_url, required=True, metavar="URL",
                        help="prefill servers (kv_role kv_producer)")
    parser.add_argument("--decode", nargs="+", type=_url, required=True, metavar="URL",
                        help="decode servers (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=parse_port, default=8000, help="port to listen on")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an upstream call may take (default 600)")
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=MAX_REQUEST_BYTES,
                        help="largest accepted request body (413 beyond; as `serve`)")
    parser.add_argument("--body-read-timeout", type=parse_positive_float,
                        default=BODY_READ_TIMEOUT_S,
                        help="seconds a request may take to send its body (408 after)")
    parser.add_argument("--kv-secret-file", default=None, metavar="PATH",
                        help="file holding the shared KV secret the router signs its prefill "
                             "requests with (default: $WIDESERVE_KV_SECRET; the instances' own)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error", "critical"),
                        help="log verbosity")
    return parser


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from wideserve.config.kv_transfer import SECRET_ENV, load_secret
    from wideserve.serving.openai.pd_router import RouterConfig, build_app
    try:
        secret = load_secret(args.kv_secret_file)
    except OSError as e:
        print(f"wideserve router: error: --kv-secret-file: {e}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"wideserve router: error: the router signs its prefill requests with the shared "
              f"KV secret: set ${SECRET_ENV} (the same as on the instances, >= 16 bytes) or "
              f"--kv-secret-file", file=sys.stderr)
        return 2
    app = build_app(RouterConfig(args.prefill, args.decode, args.max_request_bytes,
                                 args.body_read_timeout, kv_secret=secret,
                                 timeout_s=args.timeout))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
