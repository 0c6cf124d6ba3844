"""What the P/D part of the simulator needs, measured on this machine with the engine's code
(`wideserve simulate calibrate --pd`; docs/simulator.md):

- prefill: seconds of one prompt of n tokens on ONE rank of the real engine (its step timer:
  host + forward of the prefill steps, from runs that differ only in prompt length).
- NIXL transfer: two NIXL agents (UCX, this process and a spawned peer, loopback) move pages
  the way the connector does: per-transfer time from one-page transfers, bytes/s from one
  packed transfer of many pages; t = transfers * per_transfer + bytes / bytes_per_s.
- admission: the decode host's work to admit ONE remote KV load of n tokens on a model's KV
  layout: prefix-cache lookup, `allocate_slots` with external tokens, `plan_pages` and
  `descriptor_indices` (the scheduler and connector code that runs before a load starts).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096


def step_totals(llm: Any) -> dict[str, float]:
    """The engine's cumulative step counters: steps, forward and host seconds."""
    from wideserve.engine import engine_ipc as ipc
    s = ipc.to_builtins(llm.engine.get_stats())["steps"]
    sec = s["seconds"]
    return {"steps": s["steps"], "forward": sec["forward"],
            "host": sum(sec[k] for k in ("schedule", "prepare", "sample", "output"))}


def measure_prefill(model_dir: str, lengths: list[int], extra: dict[str, Any] | None = None,
                    reps: int = 3) -> dict[str, list[float]]:
    """Seconds of host + forward per prompt of n tokens (the least-disturbed of `reps`; noise
    only adds time), max_tokens = 1 so only the prefill step runs."""
    from wideserve import LLM, SamplingParams

    kw = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              enable_prefix_caching=False,
              max_num_batched_tokens=max(lengths) + 64)
    kw.update(extra or {})
    llm = LLM(model_dir, **kw)
    rng = np.random.default_rng(3)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    try:
        llm.generate([{"prompt_token_ids": [5] * 8}], sp, use_tqdm=False)     # warm-up
        for n in lengths:
            best = float("inf")
            for _ in range(reps):
                a = step_totals(llm)
                llm.generate([{"prompt_token_ids": rng.integers(2, 500, n).tolist()}], sp,
                             use_tqdm=False)
                b = step_totals(llm)
                best = min(best, (b["host"] + b["forward"]) - (a["host"] + a["forward"]))
            out.append(best)
    finally:
        llm.shutdown()
    return {"tokens": [float(n) for n in lengths], "s": out}


# ---------------------------------------------------------------------- NIXL on loopback
def _agent(name: str) -> Any:
    from wideserve.disagg.nixl_worker import import_nixl
    api = import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _table(addr: int, pages: int) -> np.ndarray:
    return np.stack([addr + np.arange(pages, dtype=np.int64) * PAGE, np.full(pages, PAGE),
                     np.zeros(pages, np.int64)], 1)


def _nixl_peer(pages: int, conn: Any) -> None:
    """The producer: registers a buffer, publishes its metadata, waits to be read."""
    import torch
    torch.set_num_threads(1)
    agent = _agent("sim-producer")
    buf = torch.ones(pages * PAGE, dtype=torch.uint8)
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()                       # the consumer is done
    conn.close()


def _read(agent: Any, local: Any, remote: Any, idx: np.ndarray) -> None:
    h = agent.make_prepped_xfer("READ", local, idx, remote, idx)
    agent.transfer(h)
    while agent.check_xfer_state(h) == "PROC":
        time.sleep(0.0001)            # yield: a busy poll starves UCX progress on few cores
    agent.release_xfer_handle(h)


def measure_nixl(pages: int = 1024, reps: int = 30) -> dict[str, float]:
    """Pull (READ) on loopback: per-transfer seconds (median of one-page transfers) and
    bytes/s (one packed transfer of `pages` contiguous pages, per-transfer time removed)."""
    import torch
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_MODULES", "^ib")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_peer, args=(pages, child))
    proc.start()
    try:
        meta, addr = parent.recv()
        agent = _agent("sim-consumer")
        buf = torch.zeros(pages * PAGE, dtype=torch.uint8)
        agent.register_memory([buf])
        name = agent.add_remote_agent(meta)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _table(buf.data_ptr(), pages), "DRAM")
        remote = agent.prep_xfer_dlist(name, _table(addr, pages), "DRAM")
        one = np.array([0], dtype=np.int32)
        _read(agent, local, remote, one)                  # connect
        small = []
        for _ in range(reps):
            t = time.perf_counter()
            _read(agent, local, remote, one)
            small.append(time.perf_counter() - t)
        every = np.arange(pages, dtype=np.int32)
        big = []
        for _ in range(max(3, reps // 6)):
            t = time.perf_counter()
            _read(agent, local, remote, every)
            big.append(time.perf_counter() - t)
        if int(buf.sum()) != pages * PAGE:
            raise RuntimeError("NIXL calibration: the pulled pages do not match")
        per = statistics.median(small)
        span = max(min(big) - per, 1e-9)
        return {"per_transfer_s": per, "bytes_per_s": pages * PAGE / span,
                "page_bytes": PAGE, "pages": pages}
    finally:
        parent.send("done")
        proc.join(30)


# ---------------------------------------------------------------------- admission
def kv_specs(model_dir: str | Path) -> dict:
    """The model's own KV cache specs (built on the meta device: no weights)."""
    import torch

    from wideserve.worker.model_loader import build_model, read_config, resolve_dtype
    from wideserve.models.registry import resolve_model_class
    config = read_config(Path(model_dir))
    cls = resolve_model_class(config)
    model = build_model(cls, cls.config_class.from_dict(config), resolve_dtype("auto", config),
                        torch.device("meta"))
    return model.kv_cache_specs("auto")


def measure_admission(model_dir: str | Path, tokens: list[int], block_size: int = 256,
                      reps: int = 3) -> dict[str, Any]:
    """Host seconds to admit one remote KV load of n tokens (lookup + allocate + plan)."""
    from wideserve.config import CacheConfig, SchedulerConfig
    from wideserve.kv_cache.groups import build_kv_cache_config
    from wideserve.kv_cache.kv_cache_manager import KVCacheManager
    from wideserve.disagg.layout import (cdiv, descriptor_indices, group_plans, plan_pages,
                                         region_bases)
    from wideserve.types.request import Request
    from wideserve.types.sampling_params import SamplingParams
    specs = kv_specs(model_dir)
    out = []
    for n in tokens:
        cache = CacheConfig(block_size=block_size, num_blocks_override=cdiv(n, block_size) * 4
                            + 64)
        kv_config = build_kv_cache_config(specs, cache, SchedulerConfig(max_num_seqs=4))
        groups = group_plans(kv_config)
        base = region_bases([b.num_blocks for b in kv_config.buckets for _ in range(b.num_slabs)])
        prompt = [(7 * i) % 120000 + 2 for i in range(n)]
        best = float("inf")
        for rep in range(reps):
            kv = KVCacheManager(kv_config, cache, n + 16)
            req = Request(f"r{rep}", prompt, SamplingParams(max_tokens=1))
            t = time.perf_counter()
            hit, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is None:
                raise RuntimeError(f"admission calibration: no room for {n} tokens")
            rows = kv.block_ids(req.request_id)
            local, remote = plan_pages(groups, rows, rows, 0, n - 1)
            descriptor_indices(groups, base, local)
            descriptor_indices(groups, base, remote)
            best = min(best, time.perf_counter() - t)
            kv.free(req)
        out.append(best)
    return {"tokens": [float(n) for n in tokens], "s": out, "model": str(model_dir),
            "block_size": block_size}
