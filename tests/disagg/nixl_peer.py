"""One side of a NIXL transfer between two processes (run as a script by test_nixl.py).

    producer HOST PORT_FILE OP    serve a filled KV layout, hold leases "req0", "expired"
                                  and "req1", exit once req0 (OP faults: all) is released
                                  (prints a JSON line with the outcome)
    consumer HOST PORT_FILE OP    wait for the producer's port, load req0's pages (OP: pull =
                                  READ them, push = have the producer WRITE them), check
                                  every byte, print a JSON line
    consumer HOST PORT_FILE faults   push faults: req0 pushed; "expired" (its lease expired)
                                  refused; then the producer is stopped (SIGSTOP) and req1's
                                  push times out (reports whether req1's pages stayed
                                  untouched once the producer runs again)

Both build the same small KV layout (so the fingerprints agree); the producer's page
(region r, block b) holds a pattern of (r, b), which the consumer checks after the pull.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import msgspec
import numpy as np
import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.core.kv_cache.groups import allocate_kv_tensors, build_kv_cache_config
from wideserve.core.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.disagg.config import KVTransferConfig
from wideserve.disagg.layout import KVLayout, plan_pages
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import LoadSpec, RemoteKV

BLOCKS = 32
REMOTE_ROWS = [list(range(3, 3 + 8)), [0, 0, 0, 0, 0, 0, 20, 21]]   # full group, window group
LOCAL_ROWS = [list(range(12, 20)), [0, 0, 0, 0, 0, 0, 5, 9]]
LOCAL_ROWS1 = [list(range(21, 29)), [0, 0, 0, 0, 0, 0, 29, 30]]
LEASES = {"req0": 60.0, "expired": 0.001, "req1": 60.0}
START, END = 0, 8 * 16 - 1


def layout() -> KVLayout:
    specs = {f"l{i}.kv": KVCacheSpec(CacheKind.FULL, "kv", 64, torch.float32) for i in range(2)}
    specs.update({f"l{i}.window": KVCacheSpec(CacheKind.SLIDING_WINDOW, "window", 32,
                                              torch.float32, window=16) for i in range(2)})
    cfg = build_kv_cache_config(specs, CacheConfig(block_size=16, num_blocks_override=BLOCKS),
                                SchedulerConfig(max_num_seqs=2))
    return KVLayout(cfg, allocate_kv_tensors(cfg, "cpu"))


def pattern(region: int, block: int, page_bytes: int) -> torch.Tensor:
    return ((torch.arange(page_bytes) * (region + 3) + block * 7) % 251).to(torch.uint8)


def producer(host: str, port_file: str, op: str) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    lay = layout()
    for r, reg in enumerate(lay.regions):
        pages = reg.tensor.view(reg.num_blocks, reg.page_bytes)
        for b in range(reg.num_blocks):
            pages[b] = pattern(r, b, reg.page_bytes)
    leases = LeaseTable()
    for rid, lease_s in LEASES.items():
        leases.grant(rid, lease_s, REMOTE_ROWS)
    worker = NixlWorker(KVTransferConfig(kv_role="kv_producer", engine_id="prod",
                                         kv_ip=host), lay, leases)
    host, port = worker.advertise()
    with open(port_file + ".tmp", "w") as f:
        json.dump({"host": host, "port": port, "pid": os.getpid()}, f)
    os.replace(port_file + ".tmp", port_file)
    deadline = time.monotonic() + 60
    released: set[str] = set()
    # Until req0 is released (plain runs), or all three (faults; "expired" when the push
    # finds its lease gone).
    wanted = set(LEASES) if op == "faults" else {"req0"}
    while time.monotonic() < deadline and not wanted <= released:
        worker.get_finished()           # a push's write is watched here
        released.update(leases.take_released())
        time.sleep(0.01)
    print(json.dumps({"released": sorted(released), "pushed": worker.pusher.num_pushed,
                      "refused": worker.server.num_refused}), flush=True)
    worker.close()


def _load(worker, lay: KVLayout, host: str, port: int, rid: str, local_rows: list[list[int]]):
    remote = RemoteKV(remote_engine_id="prod", remote_host=host, remote_port=port,
                      remote_request_id=rid, remote_block_ids=REMOTE_ROWS,
                      remote_num_tokens=END + 1, remote_layout=lay.fingerprint)
    local, rem = plan_pages(lay.groups, local_rows, REMOTE_ROWS, START, END)
    worker.start_load(LoadSpec(rid, remote, local, rem))
    deadline = time.monotonic() + 30
    result = worker.get_finished()
    while not (result.finished_loads or result.failed_loads) and time.monotonic() < deadline:
        time.sleep(0.002)
        result = worker.get_finished()
    return result, local, rem, remote


def _untouched(lay: KVLayout, rows: list[list[int]]) -> bool:
    return not any(reg.tensor.view(reg.num_blocks, reg.page_bytes)[[b for b in row if b]].any()
                   for g, row in zip(lay.groups, rows)
                   for reg in (lay.regions[r] for r in g.regions.tolist()))


def faults(host: str, port_file: str) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    lay = layout()
    info = _wait_for(port_file)
    worker = NixlWorker(KVTransferConfig(kv_role="kv_consumer", engine_id="cons",
                                         kv_load_timeout_s=3, kv_transfer_op="push"),
                        lay, LeaseTable())
    out = {"req0": bool(_load(worker, lay, host, info["port"], "req0",
                              LOCAL_ROWS)[0].finished_loads)}
    out["expired"] = _load(worker, lay, host, info["port"], "expired",
                           LOCAL_ROWS1)[0].failed_loads.get("expired", "")
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        start = time.monotonic()
        result, _, _, remote = _load(worker, lay, host, info["port"], "req1", LOCAL_ROWS1)
        out["stalled"] = result.failed_loads.get("req1", "")
        out["stalled_s"] = time.monotonic() - start
    finally:
        os.kill(info["pid"], signal.SIGCONT)
    # The producer answers in order: by its reply to this release, it has seen the stale push.
    worker.client.call(host, info["port"], "release", msgspec.msgpack.encode(["req1"]), 10)
    out["untouched"] = _untouched(lay, LOCAL_ROWS1)
    print(json.dumps(out), flush=True)
    worker.close()


def _wait_for(port_file: str) -> dict:
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(port_file) as f:
        return json.load(f)


def consumer(host: str, port_file: str, op: str) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    lay = layout()
    port = _wait_for(port_file)["port"]
    worker = NixlWorker(KVTransferConfig(kv_role="kv_consumer", engine_id="cons",
                                         kv_load_timeout_s=20, kv_transfer_op=op), lay,
                        LeaseTable())
    result, local, rem, _ = _load(worker, lay, host, port, "req0", LOCAL_ROWS)
    ok = bool(result.finished_loads)
    if ok:
        for g, loc, rm in zip(lay.groups, local, rem):
            for r in g.regions.tolist():
                reg = lay.regions[r]
                pages = reg.tensor.view(reg.num_blocks, reg.page_bytes)
                for lb, rb in zip(loc.tolist(), rm.tolist()):
                    ok &= torch.equal(pages[lb], pattern(r, rb, reg.page_bytes))
                untouched = np.setdiff1d(np.arange(reg.num_blocks), loc)
                ok &= not pages[torch.from_numpy(untouched)].any().item()
    print(json.dumps({"ok": ok, "failed": result.failed_loads, "bytes": result.bytes_loaded,
                      "pages": result.pages_loaded}), flush=True)
    worker.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "producer":
        producer(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[4] == "faults":
        faults(sys.argv[2], sys.argv[3])
    else:
        consumer(sys.argv[2], sys.argv[3], sys.argv[4])
