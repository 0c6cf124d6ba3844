"""Shape statistics of the synthetic AgentX generator at full scale, against the targets of
docs/benchmarking.md (BENCHMARKS.md, "Agentic workload generator").

    .venv/bin/python benchmarks/history/agentic_generator_stats.py
"""
from __future__ import annotations

import json
from pathlib import Path

from wideserve.bench.agentic import AgenticParams, generate_sessions, trace_stats

OUT = Path(__file__).parents[1] / "results" / "agentic_generator_stats.json"


def main() -> None:
    out = {}
    for preset in ("full", "256k"):
        stats = trace_stats(generate_sessions(AgenticParams.preset(preset), 400, seed=0))
        out[preset] = stats
        print(preset, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in stats.items()}))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
