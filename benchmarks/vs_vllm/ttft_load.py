"""Where a request's time to first token goes under load (BENCHMARKS.md, "TTFT under load:
arrivals after idle").

Starts `wideserve serve` (one torch thread, as serve_compare.py does) with a trace hook in
its engine process (a sitecustomize on PYTHONPATH that wraps EngineCore.add_request and
EngineCore.step; nothing in wideserve changes), runs closed-loop streaming clients at each
concurrency (128 token ids -> 128 tokens, greedy, EOS ignored), and prints per request:

  api    send -> the engine's add_request (HTTP, parse, submit, ZMQ; and time queued in
         the socket while the engine was inside a step: it reads input between steps)
  queue  add_request -> the start of the step that produced the first token
  step   that step (its prompt tokens and admitted requests are printed)
  out    its end -> the client has the first `data:` chunk (emit, detokenise, SSE)

  PYTHONPATH=. python benchmarks/vs_vllm/ttft_load.py MODEL_DIR OUT_PREFIX [--concurrency 4 16]
      [-- SERVE ARGS]

Every timestamp is time.monotonic() (CLOCK_MONOTONIC, one clock for all processes).
Needs aiohttp (the venv has it).
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

HOOK = '''
import builtins, json, os, sys, time
_out = os.environ.get("TTFT_LOAD_TRACE")
if _out:
    _import, _done = builtins.__import__, []
    def _patch():
        import numpy as np
        from wideserve.engine import engine_core as ec, scheduler as sm
        f = open(f"{_out}.{os.getpid()}", "a", buffering=1)
        add, step, make = ec.EngineCore.add_request, ec.EngineCore.step, sm.Scheduler._make_output
        def add_request(self, req):
            ids = req.prompt_token_ids
            raw = bytes(ids[:16]) if isinstance(ids, (bytes, bytearray, memoryview)) \\
                else np.asarray(ids[:4], dtype="int32").tobytes()
            key = [int(x) for x in np.frombuffer(raw, dtype="int32")[:4]]
            f.write(json.dumps({"ev": "add", "t": time.monotonic(), "key": key}) + "\\n")
            return add(self, req)
        def make_output(self, plan):
            self._trace_out = make(self, plan)
            return self._trace_out
        def traced_step(self):
            t0 = time.monotonic()
            outs = step(self)
            so = self.scheduler._trace_out
            f.write(json.dumps({"ev": "step", "t0": t0, "t1": time.monotonic(),
                                "tokens": so.num_batched_tokens,
                                "admitted": so.num_new_admitted}) + "\\n")
            return outs
        ec.EngineCore.add_request, ec.EngineCore.step = add_request, traced_step
        sm.Scheduler._make_output = make_output
    def _hooked(name, *a, **k):
        m = _import(name, *a, **k)
        if not _done and hasattr(sys.modules.get("wideserve.engine.engine_core"), "EngineCore") \\
                and hasattr(sys.modules.get("wideserve.engine.scheduler"), "Scheduler"):
            _done.append(1)
            _patch()
        return m
    builtins.__import__ = _hooked
'''


async def _one(session: Any, target: Any, req: Any, recs: list[dict[str, Any]]) -> None:
    from serve_compare import build_body
    t0, first = time.monotonic(), None
    async with session.post(target.url, json=build_body(target, req)) as resp:
        async for raw in resp.content:
            if first is None and raw.startswith(b"data: {"):
                first = time.monotonic()
    recs.append({"t_send": t0, "t_first": first, "key": req.prompt_token_ids[:4]})


async def _run(target: Any, reqs: list[Any], c: int) -> list[dict[str, Any]]:
    import aiohttp
    sem, recs = asyncio.Semaphore(c), []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c)) as s:
        async def limited(r: Any) -> None:
            async with sem:
                await _one(s, target, r, recs)
        await asyncio.gather(*(limited(r) for r in reqs))
    return recs


def breakdown(trace: list[dict[str, Any]], recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    adds = {tuple(e["key"]): e["t"] for e in trace if e["ev"] == "add"}
    steps = [e for e in trace if e["ev"] == "step"]
    rows = []
    for r in sorted(recs, key=lambda r: r["t_send"]):
        t_add = adds[tuple(r["key"])]
        s = max((s for s in steps if s["t1"] <= r["t_first"]), key=lambda s: s["t1"])
        rows.append({"send_ms": (r["t_send"] - recs[0]["t_send"]) * 1e3,
                     "ttft": (r["t_first"] - r["t_send"]) * 1e3,
                     "api": (t_add - r["t_send"]) * 1e3, "queue": (s["t0"] - t_add) * 1e3,
                     "step": (s["t1"] - s["t0"]) * 1e3, "out": (r["t_first"] - s["t1"]) * 1e3,
                     "step_tokens": s["tokens"], "step_admitted": s["admitted"]})
    return rows


def report(c: int, rows: list[dict[str, Any]], load: float) -> None:
    med = {k: statistics.median(x[k] for x in rows) for k in ("ttft", "api", "queue", "step",
                                                              "out")}
    print(f"== concurrency {c}, {len(rows)} requests, load {load:.1f}: medians ms " +
          " ".join(f"{k} {v:.1f}" for k, v in med.items()))
    t0 = min(x["send_ms"] for x in rows)
    for x in sorted(rows, key=lambda x: x["send_ms"]):
        print(f"  send +{x['send_ms'] - t0:8.0f}  ttft {x['ttft']:7.0f}  api {x['api']:7.1f}  "
              f"queue {x['queue']:6.1f}  step {x['step']:6.0f} ({x['step_tokens']} tok, "
              f"{x['step_admitted']} admitted)  out {x['out']:5.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out_prefix", help="the trace and the rows are written under this prefix")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--port", type=int, default=8761)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]                      # after --: `wideserve serve` flags
    import serve_compare as sc
    from wideserve.bench.client import ServeTarget
    hook_dir = tempfile.mkdtemp(prefix="ttft_load_hook")
    Path(hook_dir, "sitecustomize.py").write_text(HOOK)
    trace_path = f"{a.out_prefix}.trace"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{hook_dir}",
               TTFT_LOAD_TRACE=trace_path)
    cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", str(a.model), "--port",
           str(a.port), "--dtype", "bfloat16", "--max-model-len", "1024", "--log-level",
           "warning", "--served-model-name", str(a.model), *extra]
    with open(f"{a.out_prefix}.server.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        sc.wait_ready(proc, a.port, 400)
        target = ServeTarget(f"http://127.0.0.1:{a.port}", str(a.model),
                             extra_body={"temperature": 0.0})
        asyncio.run(_run(target, sc.prompts(4, 128, 8, 99), 4))          # warm-up
        points = []
        for c in a.concurrency:
            reqs = sc.prompts(max(4, a.prompts_per_concurrency * c), 128, 128, seed=1000 * c)
            points.append((c, asyncio.run(_run(target, reqs, c)), os.getloadavg()[0]))
    finally:
        sc.stop_server(proc)
    trace = [json.loads(line) for f in glob.glob(f"{trace_path}.*") for line in open(f)]
    with open(f"{a.out_prefix}.rows.jsonl", "w") as out:
        for c, recs, load in points:
            rows = breakdown(trace, recs)
            report(c, rows, load)
            out.write(json.dumps({"concurrency": c, "load": load, "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
