"""PNG plots of `bench serve` results (matplotlib, Agg backend: no display needed).

- sweep: total (and output) throughput per GPU against P90 E2E-normalised interactivity, one
  point per concurrency, labelled with it (AgentX's "North Star" axes).
- latency: TTFT and ITL distributions (histograms and empirical CDFs) for each point.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(series: dict[str, Sequence[dict[str, Any]]], path: str | Path,
               title: str = "") -> Path:
    """series: label -> point summaries (from PointResult.summary) of one sweep each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    for label, points in series.items():
        pts = [p for p in points if p.get("completed")]
        xs = [p["e2e_interactivity_tok_s_user"]["p90"] or 0.0 for p in pts]
        for ax, key in zip(axes, ("total_token_throughput", "output_throughput")):
            ys = [p["per_gpu"][key] for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, p in zip(xs, ys, pts):
                ax.annotate(f"c={p['max_concurrency']}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
    for ax, name in zip(axes, ("total tokens/s/GPU", "output tokens/s/GPU")):
        ax.set_xlabel("P90 E2E interactivity (tokens/s/user)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput per GPU vs P90 interactivity", fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_latency(samples: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """samples: one dict per point with 'label', 'ttft_s' and 'itl_s' lists."""
    import numpy as np
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), dpi=90)
    for row, key, name in ((0, "ttft_s", "TTFT"), (1, "itl_s", "ITL")):
        for s in samples:
            v = np.sort(np.asarray(s.get(key) or [], dtype=float)) * 1e3
            if v.size == 0:
                continue
            axes[row][0].hist(v, bins=40, alpha=0.5, label=s["label"])
            axes[row][1].plot(v, np.arange(1, v.size + 1) / v.size, label=s["label"])
        axes[row][0].set_xlabel(f"{name} (ms)")
        axes[row][0].set_ylabel("count")
        axes[row][1].set_xlabel(f"{name} (ms)")
        axes[row][1].set_ylabel("CDF")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title or "TTFT and ITL distributions", fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
