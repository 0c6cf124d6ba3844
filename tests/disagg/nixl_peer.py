"""One side of a NIXL transfer between two processes (run as a script by test_nixl.py).

    producer HOST PORT_FILE       serve a filled KV layout, hold lease "req0", exit once
                                  released (prints a JSON line with the outcome)
    consumer HOST PORT_FILE OP    wait for the producer's port, load req0's pages (OP: pull =
                                  READ them, push = have the producer WRITE them), check
                                  every byte, print a JSON line

Both build the same small KV layout (so the fingerprints agree); the producer's page
(region r, block b) holds a pattern of (r, b), which the consumer checks after the pull.
"""
from __future__ import annotations

import json
import sys
import time

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


def producer(host: str, port_file: str) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    lay = layout()
    for r, reg in enumerate(lay.regions):
        pages = reg.tensor.view(reg.num_blocks, reg.page_bytes)
        for b in range(reg.num_blocks):
            pages[b] = pattern(r, b, reg.page_bytes)
    leases = LeaseTable()
    leases.grant("req0", 60.0, REMOTE_ROWS)
    worker = NixlWorker(KVTransferConfig(kv_role="kv_producer", engine_id="prod",
                                         kv_ip=host), lay, leases)
    host, port = worker.advertise()
    with open(port_file + ".tmp", "w") as f:
        json.dump({"host": host, "port": port, "fingerprint": lay.fingerprint}, f)
    import os
    os.replace(port_file + ".tmp", port_file)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not leases.take_released():
        worker.get_finished()           # a push's write is watched here
        time.sleep(0.01)
    print(json.dumps({"released": time.monotonic() < deadline,
                      "refused": worker.server.num_refused}), flush=True)
    worker.close()


def consumer(host: str, port_file: str, op: str) -> None:
    import os
    from wideserve.disagg.nixl_worker import NixlWorker
    lay = layout()
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(port_file) as f:
        port = json.load(f)["port"]
    worker = NixlWorker(KVTransferConfig(kv_role="kv_consumer", engine_id="cons",
                                         kv_load_timeout_s=20, kv_transfer_op=op), lay, LeaseTable())
    remote = RemoteKV(remote_engine_id="prod", remote_host=host, remote_port=port,
                      remote_request_id="req0", remote_block_ids=REMOTE_ROWS,
                      remote_num_tokens=END + 1, remote_layout=lay.fingerprint)
    local, rem = plan_pages(lay.groups, LOCAL_ROWS, REMOTE_ROWS, START, END)
    worker.start_load(LoadSpec("r", remote, local, rem))
    deadline = time.monotonic() + 30
    result = worker.get_finished()
    while not (result.finished_loads or result.failed_loads) and time.monotonic() < deadline:
        time.sleep(0.002)
        result = worker.get_finished()
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
        producer(sys.argv[2], sys.argv[3])
    else:
        consumer(sys.argv[2], sys.argv[3], sys.argv[4])
