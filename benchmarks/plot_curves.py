"""PNG plots from benchmarks/results/serve_*.json (written by serve_curves.sh):
throughput per GPU against P90 E2E interactivity per workload (both models as series), and
the TTFT/ITL distributions of each run."""
from __future__ import annotations

import json
from pathlib import Path

from wideserve.bench.plots import plot_latency, plot_sweep

HERE = Path(__file__).parent
MODELS = {"v4tiny": "shakespeare-v4-tiny", "qwen3moe": "qwen3-moe-small (dummy)"}


def main() -> None:
    for workload in ("random", "agentic"):
        series = {}
        for key, label in MODELS.items():
            path = HERE / "results" / f"serve_{key}_{workload}.json"
            if not path.is_file():
                continue
            res = json.loads(path.read_text())
            series[label] = res["points"]
            plot_latency(res.get("samples", []), HERE / f"serve_latency_{key}_{workload}.png",
                         title=f"{label}, {workload}: TTFT and ITL per concurrency")
        if series:
            plot_sweep(series, HERE / f"serve_sweep_{workload}.png",
                       title=f"{workload} workload, concurrency sweep (CPU, 1 thread)")


if __name__ == "__main__":
    main()
