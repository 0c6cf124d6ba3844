"""The default thread plan (wideserve/utils/threads.py) against fixed thread counts, alternated in one
run: offline throughput (`wideserve bench throughput`) and serving TTFT at concurrency 1 and a
busy front end at concurrency 8 (`wideserve serve` + `wideserve bench serve`).

  PYTHONPATH=. python benchmarks/threads_default.py [MODEL] [--rounds 2] [--configs default,1,2]
      [--busy] [--out FILE.jsonl]

--busy: each offline run once more beside another process that keeps one CPU busy (a Python
loop, started before the engine and stopped after it): `offline_busy_out_tok_s`, what the
default's governor (utils/thread_governor.py) must not lose while LLM()'s spare core is taken.

OMP_NUM_THREADS is removed from every child's environment, so "default" is what a user gets
out of the box. Prints one line per run and a median per config; --out appends each run as a
JSON line (model, round, config, the figures), which benchmarks/vs_vllm/compare.sh's
"threads" part collects to judge the default against the best fixed count.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "wideserve.entrypoints.cli"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    return env


def _flags(config: str) -> list[str]:
    return [] if config == "default" else ["--threads", config]


def offline(model: list[str], config: str, out: Path, prompts: int,
            busy: bool = False) -> float:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        subprocess.run(CLI + ["bench", "throughput", *model, *_flags(config), "--num-prompts",
                              str(prompts), "--input-len", "128", "--output-len", "64",
                              "--no-progress",
                              "--output-json", str(out)],
                       env=_env(), check=True, stdout=subprocess.DEVNULL)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(out.read_text())["backends"]["wideserve"]["output_tokens_per_s"]


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 900) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}) before it was ready")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return time.monotonic() - start
        except OSError:
            time.sleep(0.25)
    raise RuntimeError("server not ready")


def serving(model: list[str], config: str, port: int, out: Path,
            per_lane: int) -> dict[str, float]:
    log = open(out.with_suffix(".log"), "wb")
    proc = subprocess.Popen(CLI + ["serve", *model, *_flags(config), "--port", str(port)],
                            env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        result = {"ready_s": _wait_ready(proc, port)}
        for concurrency in (1, 8):
            path = out.with_name(f"{out.stem}-c{concurrency}.json")
            subprocess.run(CLI + ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                                  "--max-concurrency", str(concurrency), "--num-prompts",
                                  str(per_lane * concurrency), "--input-len", "128", "--output-len",
                                  "32", "--no-progress", "--output-json", str(path)],
                           env=_env(), check=True, stdout=subprocess.DEVNULL)
            point = json.loads(path.read_text())["points"][0]
            result[f"ttft_p50_ms_c{concurrency}"] = 1e3 * point["ttft_s"]["p50"]
            result[f"out_tok_s_c{concurrency}"] = point["output_throughput"]
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="default,1,2",
                    help="comma list: default or a --threads value")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--offline-prompts", type=int, default=32)
    ap.add_argument("--prompts-per-lane", type=int, default=8,
                    help="serving: requests per concurrent client")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--busy", action="store_true",
                    help="offline also beside a process keeping one CPU busy")
    ap.add_argument("--out", default=None, help="append every run as a JSON line here")
    args = ap.parse_args()
    model = [args.model] if args.model else []
    configs = args.configs.split(",")
    print(f"cpus {sorted(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for config in configs:             # alternated: each round runs every config
                row: dict[str, float] = {}
                if not args.skip_offline:
                    row["offline_out_tok_s"] = offline(model, config,
                                                       Path(tmp) / f"off-{rnd}-{config}.json",
                                                       args.offline_prompts)
                    if args.busy:
                        row["offline_busy_out_tok_s"] = offline(
                            model, config, Path(tmp) / f"busy-{rnd}-{config}.json",
                            args.offline_prompts, busy=True)
                if not args.skip_serving:
                    row.update(serving(model, config, args.port,
                                       Path(tmp) / f"srv-{rnd}-{config}.json",
                                       args.prompts_per_lane))
                runs[config].append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({"bench": "threads_default",
                                            "model": args.model or "default", "round": rnd,
                                            "config": config, "load": os.getloadavg()[0],
                                            **row}) + "\n")
                print(f"round {rnd} threads={config}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    print("median per config:")
    for config, rows in runs.items():
        keys = rows[0].keys()
        print(f"  threads={config}: " + ", ".join(
            f"{k} {statistics.median(r[k] for r in rows):.1f}" for k in keys))
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
