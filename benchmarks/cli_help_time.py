"""Wall time of `wideserve COMMAND --help` for one or more source trees, alternated run by run
(a load burst on a shared machine hits every tree alike); prints each tree's median.

    python benchmarks/cli_help_time.py --tree /path/to/old --tree . --repeats 5 serve

Each run is a fresh interpreter with PYTHONPATH set to the tree, as `wideserve` from a venv
whose package is that tree would be. README.md promises `serve --help` well under a second;
tests/entrypoints/test_cli_help.py checks why (no torch, numpy or engine import), not the time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="*", default=["serve"], help="subcommand words")
    p.add_argument("--tree", action="append", default=None,
                   help="source tree to time (repeat to compare; default: this one)")
    p.add_argument("--repeats", type=int, default=5, help="runs per tree")
    args = p.parse_args()
    trees = args.tree or [os.getcwd()]
    times: dict[str, list[float]] = {t: [] for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            # cwd = the tree too: `python -m` puts the working directory first on sys.path
            root = os.path.abspath(tree)
            env = {**os.environ, "PYTHONPATH": root}
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "wideserve.entrypoints.cli", *args.command,
                            "--help"], env=env, cwd=root, check=True,
                           stdout=subprocess.DEVNULL)
            times[tree].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    for tree, ts in times.items():
        print(f"{tree}: median {statistics.median(ts):.3f} s over {len(ts)} "
              f"(min {min(ts):.3f}, max {max(ts):.3f}); load average {load:.1f}")


if __name__ == "__main__":
    main()
