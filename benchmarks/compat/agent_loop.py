"""Agent-client compatibility: the real SDKs drive a three-turn tool-using agent loop each,
streamed and not, and a table says pass/fail per client and mode (clients.py has the loops
and what each checks).

    pip install -e '.[compat]'
    python benchmarks/compat/agent_loop.py                    # starts the bundled model itself
    python benchmarks/compat/agent_loop.py --base-url http://127.0.0.1:8000 --model NAME

Without --base-url it serves the bundled tiny model (CPU, an API key, the hermes tool parser)
on a free port for the run and stops it after. Exit status 1 when any loop fails. A client
whose package is not installed is reported as "missing" (install the [compat] extra).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clients import LOOPS, Server  # noqa: E402

BUNDLED = "shakespeare-v4-tiny"
KEY = "compat-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OwnServer:
    """`wideserve serve` of the bundled model for the length of the run."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="compat-server-", suffix=".log")
        cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", "--device", "cpu",
               "--kv-cache-memory", "256MiB", "--port", str(port), "--api-key", KEY,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--log-level", "warning"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited during startup:\n" + self.output())
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise TimeoutError("the server did not become healthy:\n" + self.output())

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _failure(e: BaseException) -> str:
    """The last line that says what went wrong (an HTTP error's body when there is one)."""
    body = getattr(e, "body", None) or getattr(getattr(e, "response", None), "text", None)
    text = f"{type(e).__name__}: {e}"
    if body and str(body) not in text:
        text += f" | {body}"
    return " ".join(text.split())[:400]


def run_all(srv: Server, only: set[str] | None) -> Iterator[dict[str, Any]]:
    for (client, mode), loop in LOOPS.items():
        if only and client not in only:
            continue
        for stream in (False, True):
            row = {"client": client, "mode": mode, "stream": stream}
            start = time.perf_counter()
            try:
                row.update(result="pass", detail=loop(srv, stream))
            except ModuleNotFoundError as e:
                row.update(result="missing", detail=f"{e.name} is not installed ([compat])")
            except Exception as e:  # noqa: BLE001 - any client error is this loop's failure
                row.update(result="FAIL", detail=_failure(e))
                if os.environ.get("COMPAT_TRACEBACK"):
                    traceback.print_exc()
            row["seconds"] = round(time.perf_counter() - start, 2)
            yield row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("client", "mode", "stream", "result", "seconds", "detail")
    cells = [[str(r[k]) for k in head] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if i < 5 else 0
              for i, h in enumerate(head)]
    line = lambda c: "  ".join(v.ljust(w) if w else v for v, w in zip(c, widths))  # noqa: E731
    print(line(head))
    print(line(["-" * max(w, 6) for w in widths]))
    for c in cells:
        print(line(c))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (http://host:port); default: start "
                                      "the bundled model")
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument("--clients", help="comma-separated subset: " + ", ".join(
        sorted({c for c, _ in LOOPS})))
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    own = None if args.base_url else _OwnServer()
    try:
        base = args.base_url.rstrip("/") if args.base_url else own.url
        key = args.api_key or (KEY if own else os.environ.get("OPENAI_API_KEY", "unused"))
        model = args.model or httpx.get(base + "/v1/models", timeout=30, headers={
            "Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        only = set(args.clients.split(",")) if args.clients else None
        rows = []
        for row in run_all(Server(base, model, key), only):
            rows.append(row)
            print(f"{row['result']:>7}  {row['client']} / {row['mode']} / "
                  f"{'stream' if row['stream'] else 'whole'}", flush=True)
    finally:
        if own is not None:
            own.close()
    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["result"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
