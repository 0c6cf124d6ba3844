"""The security probe's P/D, router and process-fault cases (benchmarks/security_probe.py)."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from security_probe_harness import (
    MODEL, Row, Server, Sizes, TOTALS, alive, free_port, hostile_client,
    kill_all, message, metric_sum, run_case, status_case, wait_gone)
from wideserve.disagg.peer_auth import HEADER, sign_request
from wideserve.utils.procs import descendants


# ----------------------------------------------------------------- P/D pair and the router

class PD:
    """The pair, its router, and a second router whose only prefill instance is down (its
    prefill leg fails, so a request goes to decode with the client's own parameters)."""

    def __init__(self, prefill: Server, decode: Server, router: Server,
                 router_no_prefill: Server, timeout: float, secret: bytes) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router
        self.secret = secret
        self.router_no_prefill = router_no_prefill
        self.hc = hostile_client(timeout)
        self.rng = secrets.SystemRandom()

    def ids(self, n: int = 48) -> list[int]:
        return [self.rng.randrange(10, 300) for _ in range(n)]

    def handle(self, ids: list[int]) -> dict[str, Any]:
        """A handle as the router obtains it (signed with the KV secret): a leaked handle is
        where the forgery cases start."""
        content = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True}}).encode()
        r = httpx.post(self.prefill.url + "/v1/completions", content=content, timeout=60,
                       headers={**self.prefill.headers, "Content-Type": "application/json",
                                HEADER: sign_request(self.secret, "POST", "/v1/completions",
                                                     content)})
        params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        if not isinstance(params, dict) or "remote_block_ids" not in params:
            raise RuntimeError(f"the prefill instance gave no handle ({r.status_code})")
        return params

    def bytes_loaded(self) -> float:
        time.sleep(0.5)                 # the engine's stats reach the front end every 50 ms
        r = httpx.get(self.decode.url + "/metrics", headers=self.decode.headers, timeout=30)
        return metric_sum(r.text, "wideserve:kv_transfer_bytes_loaded_total")

    def steal(self, target: str, body: dict[str, Any], headers: dict[str, str]
              ) -> tuple[httpx.Response, float]:
        before = self.bytes_loaded()
        r = self.hc.post(target, headers=headers, json=body)
        stolen = self.bytes_loaded() - before
        TOTALS.kv_bytes_stolen += stolen
        return r, stolen


def _refused(r: httpx.Response) -> bool:
    """An error answer of any kind (the bytes obtained are what decides the case)."""
    if r.status_code != 200:
        return True
    try:
        return any(c.get("finish_reason") == "error" for c in r.json()["choices"])
    except (ValueError, KeyError, TypeError):
        return False


def pd_cases(pd: PD, sizes: Sizes) -> None:
    limit = sizes.case_timeout_s
    dec, rtr = pd.decode, pd.router

    def case(name: str, expected: str, fn: Callable[[], tuple[str, bool]]) -> None:
        run_case(Row(name, expected), fn, limit + 5)

    def forged_direct() -> tuple[str, bool]:
        ids_a, ids_b = pd.ids(), pd.ids()
        ha, hb = pd.handle(ids_a), pd.handle(ids_b)
        forged = dict(hb, remote_block_ids=ha["remote_block_ids"])
        r, stolen = pd.steal(dec.url + "/v1/completions", {
            "model": MODEL, "prompt": ids_b, "max_tokens": 4, "kv_transfer_params": forged},
            dec.headers)
        return (f"{r.status_code}, {stolen:.0f} bytes of A's KV loaded",
                stolen == 0 and _refused(r))
    case("forged KV handle (B's lease, A's blocks) to decode", "error, 0 bytes",
         forged_direct)

    def own_handle() -> tuple[str, bool]:
        """A client that reaches the prefill server asks it for a handle itself: unsigned,
        with a forged header, and with the router's real header captured on another body."""
        granted = "wideserve:kv_transfer_leases_granted_total"
        before = metric_sum(httpx.get(pd.prefill.url + "/metrics", timeout=10).text, granted)
        leg = {"model": MODEL, "prompt": pd.ids(), "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": True}}
        content = json.dumps(leg).encode()
        router_header = sign_request(pd.secret, "POST", "/v1/completions",
                                     json.dumps({**leg, "prompt": pd.ids()}).encode())
        codes = []
        for extra in ({}, {HEADER: "v1:0:00:00"}, {HEADER: router_header}):
            r = pd.hc.post(pd.prefill.url + "/v1/completions", content=content, headers={
                **pd.prefill.headers, "Content-Type": "application/json", **extra})
            codes.append(r.status_code if "kv_transfer_params" not in r.json() else 200)
        after = metric_sum(httpx.get(pd.prefill.url + "/metrics", timeout=10).text, granted)
        return (f"{codes}, leases granted {after - before:.0f}; {message(r)[:60]}",
                codes == [403] * 3 and after == before)
    case("client asks the prefill server for a KV handle (no router)",
         "403, no handle, no lease", own_handle)

    def via_router() -> tuple[str, bool]:
        ids_a, ids_b = pd.ids(), pd.ids()
        ha, hb = pd.handle(ids_a), pd.handle(ids_b)
        forged = dict(hb, remote_block_ids=ha["remote_block_ids"])
        r, stolen = pd.steal(pd.router_no_prefill.url + "/v1/completions", {
            "model": MODEL, "prompt": ids_b, "max_tokens": 4,
            "kv_transfer_params": forged}, dec.headers)
        return (f"{r.status_code}, {stolen:.0f} bytes of A's KV loaded "
                f"{message(r)[:50]}", stolen == 0)
    case("forged KV handle through the router (prefill leg down)",
         "client params stripped, 0 bytes",
         via_router)

    nested = ("[" * 200_000 + "]" * 200_000).encode()
    case("deeply nested JSON to the router", "400",
         lambda: status_case(pd.hc, "POST", rtr.url + "/v1/completions",
                              ok=lambda c: c == 400, limit_s=5, content=nested,
                              headers={**dec.headers, "Content-Type": "application/json"}))

    big = ('{"model":"%s","max_tokens":1,"prompt":"' % MODEL
           + "a" * (sizes.router_body_mb << 20) + '"}').encode()
    def body_limit() -> tuple[str, bool]:
        legs = "wideserve_router_prefill_seconds_count"
        before = metric_sum(httpx.get(rtr.url + "/metrics", timeout=10).text, legs)
        obs, ok = status_case(pd.hc, "POST", rtr.url + "/v1/completions",
                               ok=lambda c: c == 413, limit_s=15, content=big,
                               headers={**dec.headers, "Content-Type": "application/json"})
        after = metric_sum(httpx.get(rtr.url + "/metrics", timeout=10).text, legs)
        forwarded = after > before
        return obs + ("; forwarded upstream" if forwarded else ""), ok and not forwarded
    case(f"{sizes.router_body_mb} MB body to the router", "413 by the router itself",
         body_limit)

    case("text/plain body to the router", "415 (the server's Content-Type check)",
         lambda: status_case(pd.hc, "POST", rtr.url + "/v1/completions",
                              ok=lambda c: c == 415, limit_s=5,
                              content=json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                              headers={**dec.headers, "Content-Type": "text/plain"}))

    case("router /v1/models with Authorization", "200 (header forwarded)",
         lambda: status_case(pd.hc, "GET", rtr.url + "/v1/models", ok=lambda c: c == 200,
                              limit_s=5, headers=dec.headers))

    case("router /v1/responses", "200 (routed)",
         lambda: status_case(pd.hc, "POST", rtr.url + "/v1/responses",
                              ok=lambda c: c == 200, limit_s=30, headers=dec.headers,
                              json={"model": MODEL, "input": "Hello",
                                    "max_output_tokens": 4}))

    case("side-channel junk flood", "P/D request latency + < 1 s during the flood",
         lambda: _junk_flood(pd))

    run_case(Row("decode server SIGKILLed mid-stream (router)", "error event, then [DONE]",
                 hostile=False), lambda: _decode_death(pd), limit + 5)
    # 503 is the answer expected here: not a hostile request's 5xx (not counted).
    run_case(Row("router /health with no decode server", "503", hostile=False),
             lambda: status_case(httpx.Client(timeout=10), "GET", rtr.url + "/health",
                                  ok=lambda c: c == 503, limit_s=5), 20)

    def gauge() -> tuple[str, bool]:
        text = httpx.get(rtr.url + "/metrics", timeout=10).text
        left = metric_sum(text, "wideserve_router_in_flight")
        return f"in flight {left:.0f}", left == 0
    run_case(Row("router in-flight gauge after the errors", "0", hostile=False), gauge, 20)


def _router_latency(pd: PD, n: int = 3) -> float:
    times = []
    for _ in range(n):
        start = time.monotonic()
        r = httpx.post(pd.router.url + "/v1/completions", headers=pd.decode.headers,
                       timeout=60, json={"model": MODEL, "prompt": pd.ids(), "max_tokens": 2})
        r.raise_for_status()
        times.append(time.monotonic() - start)
    return sorted(times)[len(times) // 2]


def _junk_flood(pd: PD) -> tuple[str, bool]:
    import zmq
    handle = pd.handle(pd.ids())
    base = _router_latency(pd)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        junk = _junk_envelope(16 << 20)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(f"tcp://{handle['remote_host']}:{handle['remote_port']}")
        while not stop.is_set():
            try:
                sock.send_multipart(junk, zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                time.sleep(0.001)
        sock.close()
        ctx.term()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        during = _router_latency(pd)
    finally:
        stop.set()
        t.join(5)
    return (f"median {base:.2f} s before, {during:.2f} s during ({sent[0]} x 16 MB junk)",
            during < base + 1.0)


def _junk_envelope(size: int) -> list[bytes]:
    """A well-formed side-channel request (header frame + body frame, as SideChannelClient
    sends it) with a wrong MAC around `size` random bytes, claiming the decode instance's
    peer id, from its address (loopback): all an attacker without the secret can send."""
    import msgspec

    from wideserve.disagg import side_channel
    head = side_channel.Header(side_channel.VERSION, "release", time.time(), os.urandom(16),
                               "decode", os.urandom(32), b"\0" * 32)
    return [msgspec.msgpack.encode(head), os.urandom(size)]


def _decode_death(pd: PD) -> tuple[str, bool]:
    body = {"model": MODEL, "prompt": "To be, or not to be", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    events: list[str] = []
    start = time.monotonic()
    with httpx.stream("POST", pd.router.url + "/v1/completions", json=body,
                      headers=pd.decode.headers, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                events.append(line[5:].strip())
                break
        pd.decode.proc.kill()
        try:
            for line in lines:
                if line.startswith("data:"):
                    events.append(line[5:].strip())
        except httpx.HTTPError as e:
            events.append(f"<cut: {type(e).__name__}>")
    tail = events[-2:]
    ok = len(tail) == 2 and tail[1] == "[DONE]" and '"error"' in tail[0]
    return f"{len(events)} events, last {[e[:40] for e in tail]}", ok and \
        time.monotonic() - start < 30


# ------------------------------------------------------------------------ process faults

def free_port_block(n: int) -> int:
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _rank_pids(server_pid: int) -> list[int]:
    return [p for p in descendants(server_pid)
            if b"engine_proc" in Path(f"/proc/{p}/cmdline").read_bytes()]


def dep_stopped_rank(timeout_s: float) -> tuple[str, bool]:
    srv = Server("serve", ["--served-model-name", MODEL, "-dp", "2", "--enable-expert-parallel",
                           "--data-parallel-rpc-port", str(free_port_block(6)),
                           "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
                           "--engine-heartbeat-timeout", "2", "--engine-stall-timeout", "5",
                           "--log-level", "warning"])
    ranks = _rank_pids(srv.proc.pid)
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "To be", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "temperature": 0.0}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        first.set()
        except httpx.HTTPError as e:
            events.append(f"<{type(e).__name__}>")
        first.set()

    try:
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        if not first.wait(60) or len(ranks) != 2:
            return f"no stream or {len(ranks)} ranks", False
        os.kill(ranks[-1], signal.SIGSTOP)
        stopped = time.monotonic()
        health_s = None
        while time.monotonic() - stopped < timeout_s:
            if health_s is None and not srv.healthy(2.0):
                health_s = time.monotonic() - stopped
            if health_s is not None and not t.is_alive():
                break
            time.sleep(0.2)
        t.join(max(0.0, timeout_s - (time.monotonic() - stopped)))
        error_s = time.monotonic() - stopped if not t.is_alive() else None
        erred = any('"error"' in e for e in events[-3:])
        obs = (f"/health failed after {health_s:.1f} s" if health_s is not None
               else "/health stayed 200") + (
            f"; stream ended after {error_s:.1f} s {'with' if erred else 'WITHOUT'} an error"
            if error_s is not None else "; stream still hanging")
        return obs, (health_s is not None and health_s < 10 and error_s is not None
                     and error_s < 20 and erred)
    finally:
        kill_all(ranks)
        srv.proc.kill()
        srv.proc.wait()


def sigkilled_server(srv: Server) -> tuple[str, bool]:
    tree = descendants(srv.proc.pid)
    srv.proc.kill()
    srv.proc.wait()
    left = wait_gone(tree, 5.0)
    names = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2][:40].decode(errors="replace")
             for p in left if alive(p)]
    kill_all(left)
    return (f"{len(left)} of {len(tree)} children alive 5 s later {names}"
            if left else f"all {len(tree)} children gone"), not left
