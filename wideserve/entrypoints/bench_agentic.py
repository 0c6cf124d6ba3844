"""`wideserve bench gen-agentic --out DIR`: write synthetic agentic sessions as Weka traces."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_generator_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """Generator knobs (shared with `bench serve --dataset agentic`, there prefixed)."""
    g = p.add_argument_group("agentic generator")
    g.add_argument(f"--{prefix}preset", default="256k", choices=("full", "256k"),
                   help="AgentX v1.0 shape: full (1M context) or the 256k variant")
    g.add_argument(f"--{prefix}scale", type=float, default=1.0,
                   help="multiply every token count (e.g. 0.003 for a 1k-context CPU model)")
    g.add_argument(f"--{prefix}sessions", type=int, default=32, help="sessions (traces)")
    g.add_argument(f"--{prefix}seed", type=int, default=0, help="generator seed")
    g.add_argument(f"--{prefix}context-cap", type=int, default=None,
                   help="compaction threshold in tokens before scaling (default: the preset's)")
    g.add_argument(f"--{prefix}min-osl", type=int, default=1,
                   help="floor on recorded output tokens after scaling")
    g.add_argument(f"--{prefix}block-size", type=int, default=64,
                   help="tokens per hash block in the traces")


def generator_params(args: argparse.Namespace, prefix: str = "") -> Any:
    from wideserve.bench.agentic import AgenticParams

    def get(key: str) -> Any:
        return getattr(args, prefix.replace("-", "_") + key)

    overrides: dict[str, Any] = {"scale": get("scale"), "min_osl": get("min_osl"),
                                 "block_size": get("block_size")}
    if get("context_cap") is not None:
        overrides["context_cap"] = get("context_cap")
    if overrides["scale"] <= 0:
        raise ValueError("--scale must be > 0")
    return AgenticParams.preset(get("preset"), **overrides)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for the trace JSON files")
    p.add_argument("--stats-json", default=None,
                   help="also write the corpus statistics here (outside --out: AIPerf "
                        "reads every *.json in the trace directory)")
    add_generator_arguments(p)


def run(args: argparse.Namespace) -> int:
    from wideserve.bench.agentic import generate_sessions, trace_stats, write_traces
    try:
        params = generator_params(args)
    except ValueError as exc:
        print(f"wideserve bench gen-agentic: error: {exc}", file=sys.stderr)
        return 2
    sessions = generate_sessions(params, args.sessions, args.seed)
    paths = write_traces(sessions, args.out)
    stats = trace_stats(sessions)
    print(f"wrote {len(paths)} traces to {args.out}")
    print(json.dumps(stats, indent=2))
    if args.stats_json:
        Path(args.stats_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.stats_json).write_text(json.dumps(stats, indent=2) + "\n")
    return 0
