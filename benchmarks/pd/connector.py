"""One request's KV load through the real NIXL connector (NixlWorker) between two processes:
push vs pull, packed vs per_block, scattered vs contiguous blocks, default UCX vs tcp.

    python benchmarks/pd/connector.py [--tokens 4096] [--layers 16] [--repeats 5] [--tcp]
                                      [--progress-poll-us 1000]

Unlike transfer.py (raw NIXL), this times what the decode engine waits for: from
`start_load` to the load reported done by `get_finished`, including the side-channel calls
(pull: the release/confirm; push: the push request and the notification) and the producer's
lease bookkeeping. The producer polls its worker every 0.5 ms as an idle engine does. The
layout is V4-like: `--layers` growing groups' slabs of 16-token pages of 576 bf16 values.
Prints one JSON line per configuration.
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

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import allocate_kv_tensors, build_kv_cache_config
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.config.kv_transfer import DEFAULT_PROGRESS_POLL_US, KVTransferConfig
from wideserve.disagg.layout import KVLayout, plan_pages
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import LoadSpec, RemoteKV

BLOCK = 16
CONFIGS = [(op, mode) for op in ("pull", "push") for mode in ("per_block", "packed")]


def _layout(layers: int, blocks: int) -> KVLayout:
    specs = {f"l{i}.kv": KVCacheSpec(CacheKind.FULL, "kv", 576, torch.bfloat16)
             for i in range(layers)}
    cfg = build_kv_cache_config(specs, CacheConfig(block_size=BLOCK, num_blocks_override=blocks),
                                SchedulerConfig(max_num_seqs=4))
    return KVLayout(cfg, allocate_kv_tensors(cfg, "cpu"))


def _rows(pages: int, blocks: int, scattered: bool, seed: int) -> list[int]:
    if scattered:
        return (np.random.default_rng(seed).permutation(blocks - 1)[:pages] + 1).tolist()
    return list(range(1, pages + 1))


def producer(args: argparse.Namespace) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    pages = -(-args.tokens // BLOCK)
    lay = _layout(args.layers, 3 * pages)
    for r in lay.regions:
        r.tensor.copy_((torch.arange(r.tensor.numel()) % 251).to(torch.uint8))
    leases = LeaseTable()
    worker = NixlWorker(KVTransferConfig(kv_role="kv_producer", engine_id="bench-prod",
                                         kv_progress_poll_us=args.progress_poll_us), lay, leases)
    host, port = worker.advertise()
    print(json.dumps({"port": port}), flush=True)
    for line in iter(sys.stdin.readline, ""):
        cmd = json.loads(line)
        if cmd["op"] == "bye":
            break
        lease = leases.grant(cmd["rid"], 600.0, [cmd["rows"]], cmd["tokens"])
        print(json.dumps({"ok": True, "lease": lease}), flush=True)
        deadline = time.monotonic() + 60
        while not leases.take_released() and time.monotonic() < deadline:
            worker.get_finished()
            time.sleep(0.0005)
    worker.close()


def _reply(proc: subprocess.Popen) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the producer exited")
        if line.startswith("{"):
            return json.loads(line)


def _load_once(worker, lay: KVLayout, proc, port: int, rid: str, remote_rows: list[int],
               local_rows: list[int], tokens: int) -> float:
    proc.stdin.write(json.dumps({"op": "grant", "rid": rid, "rows": remote_rows,
                                 "tokens": tokens + 1}) + "\n")
    proc.stdin.flush()
    lease = _reply(proc)["lease"]
    remote = RemoteKV(remote_engine_id="bench-prod", remote_host="127.0.0.1", remote_port=port,
                      remote_request_id=rid, remote_block_ids=[remote_rows],
                      remote_num_tokens=tokens + 1, remote_layout=lay.fingerprint,
                      remote_lease=lease)
    local, rem = plan_pages(lay.groups, [local_rows], [remote_rows], 0, tokens)
    start = time.perf_counter()
    worker.start_load(LoadSpec(rid, remote, local, rem))
    while True:
        res = worker.get_finished()
        if res.finished_loads or res.failed_loads:
            break
        time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    if res.failed_loads:
        raise RuntimeError(res.failed_loads)
    return elapsed


def consumer(args: argparse.Namespace, proc: subprocess.Popen, port: int) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    pages = -(-args.tokens // BLOCK)
    lay = _layout(args.layers, 3 * pages)
    nbytes = pages * sum(r.page_bytes for r in lay.regions)
    n = 0
    for scattered in (True, False):
        remote_rows = _rows(pages, 3 * pages, scattered, 1)
        local_rows = _rows(pages, 3 * pages, scattered, 2)
        for op, mode in CONFIGS:
            worker = NixlWorker(KVTransferConfig(
                kv_role="kv_consumer", engine_id=f"bench-cons-{n}", kv_transfer_op=op,
                kv_load_timeout_s=60, kv_connector_extra_config={"transfer_mode": mode},
                kv_progress_poll_us=args.progress_poll_us),
                lay, LeaseTable())
            times = []
            for _ in range(args.repeats + 1):          # the first includes the handshake
                n += 1
                times.append(_load_once(worker, lay, proc, port, f"r{n}", remote_rows,
                                        local_rows, args.tokens))
                for r in lay.regions:
                    assert torch.equal(r.tensor.view(r.num_blocks, r.page_bytes)[local_rows[0]],
                                       (torch.arange(r.page_bytes) + remote_rows[0] * r.page_bytes)
                                       .remainder(251).to(torch.uint8))
            worker.close()
            steady = sorted(times[1:])
            med = steady[len(steady) // 2]
            print(json.dumps({"blocks": "scattered" if scattered else "contiguous", "op": op,
                              "mode": mode, "tcp": args.tcp, "tokens": args.tokens,
                              "progress_poll_us": args.progress_poll_us,
                              "MiB": round(nbytes / 2**20, 1), "descriptors": pages * len(lay.regions),
                              "first_ms": round(times[0] * 1e3, 2),
                              "median_ms": round(med * 1e3, 2),
                              "GB_s": round(nbytes / med / 1e9, 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp (the inter-node path)")
    ap.add_argument("--progress-poll-us", type=int, default=DEFAULT_PROGRESS_POLL_US,
                    help="kv_progress_poll_us of both agents (0: NIXL's busy poll)")
    ap.add_argument("role", nargs="?", default="consumer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role == "producer":
        producer(args)
        return
    os.environ.setdefault("WIDESERVE_KV_SECRET", "benchmark-secret-of-32-bytes-len")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["UCX_MODULES"] = "^ib"
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"
    proc = subprocess.Popen([sys.executable, __file__, "producer", "--tokens", str(args.tokens),
                             "--layers", str(args.layers), "--progress-poll-us",
                             str(args.progress_poll_us)], env=dict(os.environ),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = _reply(proc)["port"]
        consumer(args, proc, port)
    finally:
        if proc.poll() is None:
            proc.stdin.write(json.dumps({"op": "bye"}) + "\n")
            proc.stdin.flush()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
