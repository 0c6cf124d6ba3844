"""Real `wideserve serve` prefill/decode instances (NIXL between them) and a router, as
subprocesses on loopback, for the HTTP tests of P/D (test_router_e2e.py,
test_kv_handle_attack.py)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from entrypoints.openai.oai_server_utils import RemoteServer, free_port, server_env, write_tiny_model
from wideserve.disagg.peer_auth import HEADER, sign_request

SECRET = "router-e2e-secret-0123456789abcdef"


def router_post(url: str, body: dict, path: str = "/v1/completions", secret: str = SECRET,
                timeout: float = 60) -> httpx.Response:
    """POST `body` as the router sends a prefill leg: signed with the KV secret (only such a
    request may ask a prefill instance for a KV handle: wideserve/disagg/peer_auth.py)."""
    content = json.dumps(body).encode()
    auth = sign_request(secret.encode(), "POST", path, content)
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", HEADER: auth})


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **extra})


def start_router(prefill: list[str], decode: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "wideserve.entrypoints.cli", "router", "--prefill", *prefill,
         "--decode", *decode, "--port", str(port), "--log-level", "warning"], env=server_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert router.poll() is None and time.monotonic() < deadline, "router did not start"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return router, url
        except httpx.HTTPError:
            time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def cluster(model_dir: Path, specs: dict[str, str], prefill: list[str], decode: list[str]
            ) -> Iterator[dict]:
    """`specs`: instance name -> --kv-transfer-config; yields {"router": url, name: server}."""
    model = str(write_tiny_model(model_dir))
    saved = dict(os.environ)
    os.environ.update(WIDESERVE_KV_SECRET=SECRET, UCX_NET_DEVICES="lo", UCX_MODULES="^ib")
    common = [model, "--load-format", "dummy", "--device", "cpu", "--block-size", "16",
              "--kv-cache-memory", "8MiB", "--enable-debug-endpoints"]
    servers: dict[str, RemoteServer] = {}
    router = None
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            # Each instance in its own process group: a test kills an instance (server and
            # engine core together) as a machine failure would, not the server alone.
            futs = {k: pool.submit(RemoteServer, common + ["--kv-transfer-config", v],
                                   new_session=True) for k, v in specs.items()}
            for k, f in futs.items():
                servers[k] = f.result()
        router, url = start_router([servers[k].url for k in prefill],
                                   [servers[k].url for k in decode])
        yield {"router": url, **servers}
    finally:
        if router is not None:
            stop(router)
        for s in servers.values():
            s.close()
        os.environ.clear()
        os.environ.update(saved)
