"""`wideserve bench {throughput,serve,gen-agentic}`: benchmarks.

- throughput [MODEL]: offline engine throughput, optionally beside transformers generate().
- serve --base-url URL: drive any OpenAI-compatible server with streaming requests.
- gen-agentic --out DIR: write synthetic AgentX-like sessions as Weka-trace JSON.

Heavy imports happen inside the run functions (every `wideserve` call builds this parser).
"""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from wideserve.entrypoints import (bench_agentic as agentic_cmd, bench_serve as serve_cmd,
                                       bench_throughput as throughput_cmd)
    from wideserve.entrypoints.engine_args import add_engine_args, one_line_error

    parser = subparsers.add_parser("bench", help="benchmarks (throughput, serve, gen-agentic)",
                                   description=__doc__.splitlines()[0])
    parser.error = one_line_error.__get__(parser)      # type: ignore[method-assign]
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    tp = sub.add_parser("throughput", help="offline throughput of the engine (and transformers)")
    tp.error = one_line_error.__get__(tp)              # type: ignore[method-assign]
    add_engine_args(tp)
    throughput_cmd.add_arguments(tp)
    tp.set_defaults(_bench_run=throughput_cmd.run)

    sv = sub.add_parser("serve", help="benchmark an OpenAI-compatible server over HTTP")
    sv.error = one_line_error.__get__(sv)              # type: ignore[method-assign]
    serve_cmd.add_arguments(sv)
    sv.set_defaults(_bench_run=serve_cmd.run)

    ga = sub.add_parser("gen-agentic", help="write synthetic agentic sessions (Weka traces)")
    ga.error = one_line_error.__get__(ga)              # type: ignore[method-assign]
    agentic_cmd.add_arguments(ga)
    ga.set_defaults(_bench_run=agentic_cmd.run)
    return parser


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
