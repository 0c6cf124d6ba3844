"""NIXL KV-page transfers between two processes: per-block vs packed, pull (READ) vs push
(WRITE), scattered vs contiguous pages, over UCX's default transports and over tcp.

    python benchmarks/pd/transfer.py [--pages 2000] [--page-bytes 32768] [--tcp]

Each side registers one buffer of pages; a "request" moves `--pages` pages from the
producer's buffer to the consumer's at scattered (random) or contiguous block ids:
  per_block: one NIXL transfer per page (what a naive connector does)
  packed:    one prepared transfer for the request's whole descriptor list (NIXL merges
             adjacent descriptors: contiguous pages become one large copy)
  pull = the consumer READs; push = the producer WRITEs into the consumer.
The parent is the consumer; it spawns the producer and swaps agent metadata over pipes.
Prints one JSON line per configuration (GB/s, transfers per request, ms per request).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch


def _agent(name: str):
    from wideserve.config.kv_transfer import DEFAULT_PROGRESS_POLL_US
    from wideserve.disagg.nixl_agent import new_agent
    return new_agent(name, DEFAULT_PROGRESS_POLL_US)


def _table(buf: torch.Tensor, page: int) -> np.ndarray:
    n = buf.numel() // page
    addrs = buf.data_ptr() + np.arange(n, dtype=np.int64) * page
    return np.stack([addrs, np.full(n, page), np.zeros(n, np.int64)], 1)


def _wait(agent, handles: list) -> None:
    pending = list(handles)
    while pending:
        pending = [h for h in pending if agent.check_xfer_state(h) == "PROC"]
        if pending:
            time.sleep(0.0001)      # yield: a busy poll starves UCX progress on few cores


def _run(agent, op: str, local, remote, loc: np.ndarray, rem: np.ndarray, mode: str) -> int:
    chunks = [(loc, rem)] if mode == "packed" else \
        [(loc[i:i + 1], rem[i:i + 1]) for i in range(len(loc))]
    handles = []
    for a, b in chunks:
        h = agent.make_prepped_xfer(op, local, a, remote, b)
        agent.transfer(h)
        handles.append(h)
    _wait(agent, handles)
    for h in handles:
        agent.release_xfer_handle(h)
    return len(handles)


def peer(num_pages: int, page: int) -> None:
    """Producer: serve metadata, answer 'push' commands by WRITE-ing into the consumer."""
    agent = _agent("producer")
    # Page i holds the byte i % 251, so the consumer can check where every page came from.
    buf = (torch.arange(num_pages * 4, dtype=torch.int64) % 251).to(torch.uint8) \
        .repeat_interleave(page)
    agent.register_memory([buf])
    print(json.dumps({"meta": agent.get_agent_metadata().hex(),
                      "addr": buf.data_ptr(), "n": buf.numel()}), flush=True)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _table(buf, page), "DRAM")
    remote = None
    for line in iter(sys.stdin.readline, ""):
        cmd = json.loads(line)
        if cmd["op"] == "hello":
            name = agent.add_remote_agent(bytes.fromhex(cmd["meta"]))
            t = np.stack([cmd["addr"] + np.arange(cmd["n"] // page, dtype=np.int64) * page,
                          np.full(cmd["n"] // page, page), np.zeros(cmd["n"] // page, np.int64)], 1)
            remote = agent.prep_xfer_dlist(name, t, "DRAM")
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "push":
            start = time.perf_counter()
            n = _run(agent, "WRITE", local, remote, np.asarray(cmd["src"], np.int32),
                     np.asarray(cmd["dst"], np.int32), cmd["mode"])
            print(json.dumps({"s": time.perf_counter() - start, "transfers": n}), flush=True)
        else:
            break


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--page-bytes", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp (the inter-node path)")
    ap.add_argument("role", nargs="?", default="consumer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role == "peer":
        peer(args.pages, args.page_bytes)
        return
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
               UCX_MODULES="^ib", OMP_NUM_THREADS="1")
    if args.tcp:
        env["UCX_TLS"] = "tcp"
        os.environ["UCX_TLS"] = "tcp"
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["UCX_MODULES"] = "^ib"
    proc = subprocess.Popen([sys.executable, __file__, "peer", "--pages", str(args.pages),
                             "--page-bytes", str(args.page_bytes)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _consume(proc, args)
    finally:
        proc.stdin.write(json.dumps({"op": "bye"}) + "\n")
        proc.stdin.flush()
        proc.wait(30)


def _reply(proc) -> dict:
    """The peer's next JSON line (NIXL logs to stdout too)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the producer exited")
        if line.startswith("{"):
            return json.loads(line)


def _consume(proc, args) -> None:
    page, n = args.page_bytes, args.pages
    info = _reply(proc)
    agent = _agent("consumer")
    buf = torch.zeros(n * 4 * page, dtype=torch.uint8)
    agent.register_memory([buf])
    name = agent.add_remote_agent(bytes.fromhex(info["meta"]))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _table(buf, page), "DRAM")
    t = np.stack([info["addr"] + np.arange(info["n"] // page, dtype=np.int64) * page,
                  np.full(info["n"] // page, page), np.zeros(info["n"] // page, np.int64)], 1)
    remote = agent.prep_xfer_dlist(name, t, "DRAM")
    proc.stdin.write(json.dumps({"op": "hello", "meta": agent.get_agent_metadata().hex(),
                                 "addr": buf.data_ptr(), "n": buf.numel()}) + "\n")
    proc.stdin.flush()
    _reply(proc)
    rng = np.random.default_rng(0)
    layouts = {"scattered": (rng.permutation(4 * n)[:n].astype(np.int32),
                             rng.permutation(4 * n)[:n].astype(np.int32)),
               "contiguous": (np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32) + n)}
    for lay, (src, dst) in layouts.items():
        for mode in ("per_block", "packed"):
            for direction in ("pull", "push"):
                times, transfers = [], 0
                for _ in range(args.repeats):
                    if direction == "pull":
                        start = time.perf_counter()
                        transfers = _run(agent, "READ", local, remote, dst, src, mode)
                        times.append(time.perf_counter() - start)
                    else:
                        proc.stdin.write(json.dumps({"op": "push", "src": src.tolist(),
                                                     "dst": dst.tolist(), "mode": mode}) + "\n")
                        proc.stdin.flush()
                        r = _reply(proc)
                        times.append(r["s"])
                        transfers = r["transfers"]
                pages = buf.view(-1, page)[torch.from_numpy(dst).long()]
                expect = (torch.from_numpy(src).long() % 251).to(torch.uint8)
                ok = bool((pages == expect[:, None]).all())
                buf.zero_()
                med = float(np.median(times))
                print(json.dumps({"layout": lay, "mode": mode, "direction": direction,
                                  "tls": "tcp" if args.tcp else "default",
                                  "pages": n, "page_bytes": page, "transfers": transfers,
                                  "ms": round(med * 1e3, 2),
                                  "GBps": round(n * page / med / 1e9, 2), "ok": ok}),
                      flush=True)


if __name__ == "__main__":
    main()
