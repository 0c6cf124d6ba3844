"""One side of a NIXL transfer between two processes (run as a script by test_nixl.py).

    producer HOST PORT_FILE OP    serve a filled KV layout, hold leases "req0", "expired",
                                  "req1" and "late", exit once req0 (OP faults: all) is
                                  released and a second try of it refused (prints a JSON
                                  line with the outcome); OP faults:
                                  the push of req1 stops this process (SIGSTOP) right
                                  before it posts the write (after its deadline check)
    consumer HOST PORT_FILE OP    wait for the producer's port, try a forged handle (req0's
                                  lease, other blocks: refused), load req0's pages (OP: pull
                                  = READ them, push = have the producer WRITE them), check
                                  every byte, try req0 again (refused: served once), print a
                                  JSON line
    consumer HOST PORT_FILE faults   push faults: req0 pushed; "expired" (its lease expired)
                                  refused; req1's push stalls the producer mid-push, times
                                  out and is quarantined; no new load from that producer
                                  starts; the producer is resumed (SIGCONT) and its stale
                                  write lands, in the quarantined pages only; the fence
                                  frees them; reused, they stay intact; a push whose
                                  cancel overtook it is refused

Both build the same small KV layout (so the fingerprints agree); the producer's page
(region r, block b) holds a pattern of (r, b), which the consumer checks after the pull.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import msgspec
import numpy as np
import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import allocate_kv_tensors, build_kv_cache_config
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import KVLayout, plan_pages
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import LoadSpec, RemoteKV

BLOCKS = 32
REMOTE_ROWS = [list(range(3, 3 + 8)), [0, 0, 0, 0, 0, 0, 20, 21]]   # full group, window group
LOCAL_ROWS = [list(range(12, 20)), [0, 0, 0, 0, 0, 0, 5, 9]]
LOCAL_ROWS1 = [list(range(21, 29)), [0, 0, 0, 0, 0, 0, 29, 30]]
LEASES = {"req0": 60.0, "expired": 0.001, "req1": 60.0, "late": 60.0}
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
    ids = {rid: leases.grant(rid, lease_s, REMOTE_ROWS, END + 1)
           for rid, lease_s in LEASES.items()}
    worker = NixlWorker(KVTransferConfig(kv_role="kv_producer", engine_id="prod",
                                         kv_ip=host), lay, leases)
    if op == "faults":
        post = worker.pusher._post

        def stalling_post(req, rows, budget_s):
            if req.lease.request_id == "req1":    # the deadline check has passed: stall here
                # Thread-directed: this thread stops at once. (A process-directed SIGSTOP is
                # taken by the main thread, and the others run on until it is scheduled:
                # under load long enough to accept and post a push, docs/disaggregation.md.)
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return post(req, rows, budget_s)
        worker.pusher._post = stalling_post
    host, port = worker.advertise()
    with open(port_file + ".tmp", "w") as f:
        json.dump({"host": host, "port": port, "pid": os.getpid(), "leases": ids}, f)
    os.replace(port_file + ".tmp", port_file)
    deadline = time.monotonic() + 60
    released: set[str] = set()
    # Until req0 is released (plain runs), or all three (faults; "expired" when the push
    # finds its lease gone).
    wanted = set(LEASES) if op == "faults" else {"req0"}
    # Plain runs: and until the consumer's second try of req0 has been refused.
    retried = (lambda: True) if op == "faults" else (lambda: leases.refused_unknown > 0)
    while time.monotonic() < deadline and not (wanted <= released and retried()):
        worker.get_finished()           # a push's write is watched here
        released.update(leases.take_released())
        time.sleep(0.01)
    print(json.dumps({"released": sorted(released), "pushed": worker.pusher.num_pushed,
                      **leases.counters(),
                      "refused": worker.server.num_refused,
                      "refused_after_cancel": worker.pusher.num_refused_stopped}), flush=True)
    worker.close()


def _remote(lay: KVLayout, info: dict, rid: str) -> RemoteKV:
    return RemoteKV(remote_engine_id="prod", remote_host=info["host"], remote_port=info["port"],
                    remote_request_id=rid, remote_block_ids=REMOTE_ROWS,
                    remote_num_tokens=END + 1, remote_layout=lay.fingerprint,
                    remote_lease=info["leases"][rid])


def _load(worker, lay: KVLayout, info: dict, rid: str, local_rows: list[list[int]]):
    remote = _remote(lay, info, rid)
    local, rem = plan_pages(lay.groups, local_rows, REMOTE_ROWS, START, END)
    worker.start_load(LoadSpec(rid, remote, local, rem))
    deadline = time.monotonic() + 30
    result = worker.get_finished()
    while not (result.finished_loads or result.failed_loads) and time.monotonic() < deadline:
        time.sleep(0.002)
        result = worker.get_finished()
    return result, local, rem, remote


def _pages(lay: KVLayout, rows: list[list[int]]) -> list[torch.Tensor]:
    """The pages of `rows` (consumer blocks), as [num_pages, page_bytes] views per region."""
    return [reg.tensor.view(reg.num_blocks, reg.page_bytes)[[b for b in row if b]]
            for g, row in zip(lay.groups, rows) for reg in (lay.regions[r] for r in
                                                          g.regions.tolist())]


def _holds(lay: KVLayout, local: list[np.ndarray], remote: list[np.ndarray]) -> bool:
    """Every planned consumer page holds the producer's page it was loaded from."""
    ok = True
    for g, loc, rm in zip(lay.groups, local, remote):
        for r in g.regions.tolist():
            reg = lay.regions[r]
            pages = reg.tensor.view(reg.num_blocks, reg.page_bytes)
            for lb, rb in zip(loc.tolist(), rm.tolist()):
                ok &= torch.equal(pages[lb], pattern(r, rb, reg.page_bytes))
    return ok


def _fill(lay: KVLayout, rows: list[list[int]], value: int) -> None:
    for g, row in zip(lay.groups, rows):
        for r in g.regions.tolist():
            reg = lay.regions[r]
            reg.tensor.view(reg.num_blocks, reg.page_bytes)[[b for b in row if b]] = value


def _filled(lay: KVLayout, rows: list[list[int]], value: int) -> bool:
    return all(bool((p == value).all()) for p in _pages(lay, rows))


def _wait_fenced(worker, fence: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fence in worker.get_finished().fenced:
            return True
        time.sleep(0.005)
    return False


def faults(host: str, port_file: str) -> None:
    from wideserve.disagg.nixl_worker import NixlWorker
    from wideserve.disagg.push import PushRequest, new_token, pages_to_wire
    lay = layout()
    info = _wait_for(port_file)
    port = info["port"]
    worker = NixlWorker(KVTransferConfig(kv_role="kv_consumer", engine_id="cons",
                                         kv_load_timeout_s=3, kv_transfer_op="push"),
                        lay, LeaseTable())
    out = {"req0": bool(_load(worker, lay, info, "req0", LOCAL_ROWS)[0].finished_loads)}
    out["expired"] = _load(worker, lay, info, "expired",
                           LOCAL_ROWS1)[0].failed_loads.get("expired", "")
    try:
        # req1's push stops the producer between its deadline check and its post.
        start = time.monotonic()
        result, local, rem, remote = _load(worker, lay, info, "req1", LOCAL_ROWS1)
        out["stalled"] = result.failed_loads.get("req1", "")
        out["stalled_s"] = time.monotonic() - start
        fence = result.quarantined.get("req1", "")
        out["quarantined"] = bool(fence)
        out["untouched_while_stalled"] = _filled(lay, LOCAL_ROWS1, 0)
        # No new load from a producer with an open fence.
        out["refused_while_fenced"] = _load(worker, lay, info, "late",
                                            LOCAL_ROWS)[0].failed_loads.get("late", "")
    finally:
        os.kill(info["pid"], signal.SIGCONT)
    out["fenced"] = _wait_fenced(worker, fence, 15)
    # The stale write landed, and before the fence: into quarantined pages only.
    out["landed_before_fence"] = _holds(lay, local, rem)
    # Reused by "another request": nothing of the old push may land any more.
    _fill(lay, LOCAL_ROWS1, 0xAB)
    worker.client.call(host, port, "release",
                       msgspec.msgpack.encode([_remote(lay, info, "req1").lease_ref()]), 10)
    time.sleep(0.2)
    worker.get_finished()
    out["reused_intact"] = _filled(lay, LOCAL_ROWS1, 0xAB)
    # A push overtaken by its own cancel (the cancel arrives first) is refused on arrival.
    token = new_token()
    worker.client.call(host, port, "cancel", msgspec.msgpack.encode([token]), 10)
    req = PushRequest("cons", token, _remote(lay, info, "late").lease_ref(),
                      pages_to_wire(local), pages_to_wire(rem), time.time() + 10)
    out["overtaken"] = msgspec.msgpack.decode(
        worker.client.call(host, port, "push", msgspec.msgpack.encode(req), 10))
    time.sleep(0.2)
    out["intact_after_overtaken"] = _filled(lay, LOCAL_ROWS1, 0xAB)
    worker.client.call(host, port, "release",
                       msgspec.msgpack.encode([_remote(lay, info, "late").lease_ref()]), 10)
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
    info = _wait_for(port_file)
    worker = NixlWorker(KVTransferConfig(kv_role="kv_consumer", engine_id="cons",
                                         kv_load_timeout_s=20, kv_transfer_op=op), lay,
                        LeaseTable())
    # A forged handle first: req0's lease id with other block ids. The producer refuses it
    # (counted as a mismatch) and req0's lease stays intact for the real load below.
    forged = _remote(lay, info, "req0")
    forged.remote_block_ids = [list(range(20, 28)), REMOTE_ROWS[1]]
    local, rem = plan_pages(lay.groups, LOCAL_ROWS, forged.remote_block_ids, START, END)
    worker.start_load(LoadSpec("forged", forged, local, rem))
    deadline = time.monotonic() + 30
    refused = worker.get_finished()
    while not (refused.finished_loads or refused.failed_loads) and time.monotonic() < deadline:
        time.sleep(0.002)
        refused = worker.get_finished()
    result, local, rem, _ = _load(worker, lay, info, "req0", LOCAL_ROWS)
    ok = bool(result.finished_loads) and _holds(lay, local, rem) \
        and "forged" in refused.failed_loads and not refused.finished_loads
    # The same (real) handle again: served once only, nothing lands in the new blocks.
    again = _load(worker, lay, info, "req0", LOCAL_ROWS1)[0]
    ok &= not again.finished_loads and _filled(lay, LOCAL_ROWS1, 0)
    if ok:      # and the pages no load planned were left untouched
        for g, loc in zip(lay.groups, local):
            for r in g.regions.tolist():
                reg = lay.regions[r]
                pages = reg.tensor.view(reg.num_blocks, reg.page_bytes)
                untouched = np.setdiff1d(np.arange(reg.num_blocks), loc)
                ok &= not pages[torch.from_numpy(untouched)].any().item()
    print(json.dumps({"ok": ok, "failed": result.failed_loads, "bytes": result.bytes_loaded,
                      "forged": refused.failed_loads.get("forged", ""),
                      "again": again.failed_loads.get("req0", ""),
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
