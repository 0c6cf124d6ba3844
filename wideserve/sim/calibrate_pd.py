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
- serving path (`calibrate --serving`): the same model's decode step behind one `wideserve
  serve` (engine process, ZMQ IPC, API server, detokenize, HTTP streaming to a client on
  this machine) against its in-process step: the seconds per step the serving path adds;
  and one request's latency outside the engine's steps (HTTP in, hand-over, the token
  out), which every request pays once per server it passes.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
                    reps: int = 3, keep: str = "min", temperature: float = 0.0
                    ) -> dict[str, list[float]]:
    """Seconds of host + forward per prompt of n tokens, max_tokens = 1 so only the prefill
    step runs; of `reps`, keep="min" the least-disturbed (noise only adds time), "mean" the
    typical (calibrate.measure_engine); temperature: the workload's sampling."""
    from wideserve import LLM, SamplingParams

    kw = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              enable_prefix_caching=False,
              max_num_batched_tokens=max(lengths) + 64)
    kw.update(extra or {})
    llm = LLM(model_dir, **kw)
    rng = np.random.default_rng(3)
    sp = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True)
    out = []
    try:
        llm.generate([{"prompt_token_ids": [5] * 8}], sp, use_tqdm=False)     # warm-up
        for n in lengths:
            got = []
            for _ in range(reps):
                a = step_totals(llm)
                llm.generate([{"prompt_token_ids": rng.integers(2, 500, n).tolist()}], sp,
                             use_tqdm=False)
                b = step_totals(llm)
                got.append((b["host"] + b["forward"]) - (a["host"] + a["forward"]))
            out.append(statistics.mean(got) if keep == "mean" else min(got))
    finally:
        llm.shutdown()
    return {"tokens": [float(n) for n in lengths], "s": out}


# ---------------------------------------------------------------------- NIXL on loopback
def _agent(name: str) -> Any:
    from wideserve.config.kv_transfer import DEFAULT_PROGRESS_POLL_US
    from wideserve.disagg.nixl_agent import new_agent
    # The deployment's agent: the engine's default progress-thread poll (kv_progress_poll_us).
    return new_agent(name, DEFAULT_PROGRESS_POLL_US)


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


def _resident_agent(name: str, conn: Any) -> None:
    """An idle NIXL agent with registered memory, as each P/D server's engine holds one for
    its whole life (disagg/nixl_worker.py); lives until told to stop."""
    import torch
    torch.set_num_threads(1)
    agent = _agent(name)
    buf = torch.zeros(64 * PAGE, dtype=torch.uint8)
    agent.register_memory([buf])
    conn.send("up")
    conn.recv()
    conn.close()


@contextmanager
def resident_agents(count: int) -> Iterator[None]:
    """`count` idle NIXL agents, each in its own process, for the duration: a P/D deployment
    on this machine keeps one per server (their UCX worker threads stay on the host while
    idle), and a step measured beside them pays what they take from the cores (measured
    with 2 beside the one-rank engine: decode steps 4-5x longer at load 18,
    docs/simulator.md). 0: nothing."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_MODULES", "^ib")
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_resident_agent, args=(f"sim-resident-{i}", child))
            proc.start()
            procs.append((proc, parent))
            if not parent.poll(120):
                raise RuntimeError("P/D calibration: a resident NIXL agent did not start")
            parent.recv()
        yield
    finally:
        for proc, parent in procs:
            try:
                parent.send("stop")
            except (BrokenPipeError, OSError):
                pass
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


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


# ---------------------------------------------------------------------- the serving path
def serving_table(inprocess: list[dict[str, float]], served: list[dict[str, float]]
                  ) -> dict[str, list[float]]:
    """The serving path's seconds per decode step vs batch, from the same model measured
    in-process (`measure_engine` rows: host + forward per decode step) and behind one
    `wideserve serve` (`measure_served` rows: `period` = client wall seconds per decode
    step, `engine` = the served engine's own step-timer seconds per step). Per batch:
      s       = period - in-process step   (all the serving path adds on this machine)
      loop_s  = period - served engine step (engine-proc loop, ZMQ IPC, the API server's
                detokenize and HTTP streaming: what lies outside `engine.step()`)
    s - loop_s is the served engine's own step running slower than in-process: the API
    server and client share the host's cores with it (a GPU deployment's forward does not
    compete for them, so a GPU host is charged loop_s only: step.py)."""
    by_b = {int(r["batch"]): r for r in inprocess}
    out: dict[str, list[float]] = {"batch": [], "s": [], "loop_s": [], "period_s": [],
                                   "engine_s": [], "inprocess_s": []}
    for r in sorted(served, key=lambda x: x["batch"]):
        b = int(r["batch"])
        if b not in by_b:
            raise ValueError(f"serving calibration: no in-process row at batch {b}")
        inproc = by_b[b]["host"] + by_b[b]["forward"]
        out["batch"].append(float(b))
        out["period_s"].append(r["period"])
        out["engine_s"].append(r["engine"])
        out["inprocess_s"].append(inproc)
        out["s"].append(max(r["period"] - inproc, 0.0))
        out["loop_s"].append(max(r["period"] - r["engine"], 0.0))
    return out


def _served_counters(base_url: str) -> tuple[float, float]:
    """(engine steps, engine step seconds over all phases) from the server's /metrics."""
    import httpx

    from wideserve.bench.prometheus import parse_metrics
    time.sleep(0.2)     # the engine sends changed stats every 50 ms (engine_proc.py)
    m = parse_metrics(httpx.get(base_url + "/metrics", timeout=30).text)
    return m.get("engine_steps", 0.0), m.get("engine_step_phase_seconds", 0.0)


async def _served_run(base_url: str, model: str, batch: int, prompt_len: int,
                      max_tokens: int, rng: np.random.Generator) -> float:
    """Wall seconds of `batch` streamed completions sent at once (the bench client)."""
    import httpx

    from wideserve.bench.client import ServeTarget, send_request
    from wideserve.bench.datasets import BenchRequest
    target = ServeTarget(base_url, model)
    reqs = [BenchRequest(rng.integers(2, 500, prompt_len).tolist(), max_tokens)
            for _ in range(batch)]
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        recs = await asyncio.gather(*(send_request(client, target, q) for q in reqs))
        wall = time.perf_counter() - t
    bad = [r.error for r in recs if r.error]
    if bad:
        raise RuntimeError(f"serving calibration: a request failed: {bad[0]}")
    return wall


def measure_served(base_url: str, batches: list[int], prompt_len: int, output_len: int,
                   reps: int = 2) -> list[dict[str, float]]:
    """Per batch B, against a running one-rank server: B streamed requests at once, with
    4 and 4 + output_len output tokens (the difference leaves prefill and first-token latency
    out, as `measure_engine` does in-process). period = client wall seconds per decode step,
    engine = the served engine's step-timer seconds per decode step; the mean over `reps`
    (the held-out benchmarks measure a typical minute, not the least-disturbed one)."""
    import httpx
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = np.random.default_rng(11)
    asyncio.run(_served_run(base_url, model, 1, prompt_len, 4, rng))          # warm-up
    rows = []
    for b in batches:
        period, engine = [], []
        for _ in range(reps):
            got = {}
            for n in (4, 4 + output_len):
                s0, e0 = _served_counters(base_url)
                wall = asyncio.run(_served_run(base_url, model, b, prompt_len, n, rng))
                s1, e1 = _served_counters(base_url)
                got[n] = (wall, s1 - s0, e1 - e0)
            (w_s, st_s, e_s), (w_l, st_l, e_l) = got[4], got[4 + output_len]
            steps = max(st_l - st_s, 1.0)
            period.append((w_l - w_s) / steps)
            engine.append((e_l - e_s) / steps)
        rows.append({"batch": float(b), "period": statistics.mean(period),
                     "engine": statistics.mean(engine), "period_reps": period,
                     "engine_reps": engine})
    return rows


async def _request_rows(base_url: str, prompt_len: int, reps: int, vocab: int
                        ) -> tuple[list[float], list[float]]:
    """(client seconds, engine step seconds) of `reps` streamed one-token completions sent
    one at a time over one connection (as a benchmark client keeps it), after a warm-up."""
    import httpx

    from wideserve.bench.client import ServeTarget, send_request
    from wideserve.bench.datasets import BenchRequest
    rng = np.random.default_rng(13)
    walls, engine = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]
        target = ServeTarget(base_url, model)
        for i in range(reps + 1):
            s0, e0 = _served_counters(base_url)
            rec = await send_request(client, target, BenchRequest(
                rng.integers(2, vocab, prompt_len).tolist(), 1))
            s1, e1 = _served_counters(base_url)
            if rec.error:
                raise RuntimeError(f"serving calibration: a request failed: {rec.error}")
            if i:                                   # the first one warms the path up
                walls.append(rec.end - rec.start)
                engine.append(e1 - e0)
    return walls, engine


def measure_request(base_url: str, prompt_len: int, reps: int = 8, vocab: int = 500
                    ) -> dict[str, Any]:
    """A served request's latency outside the engine's steps, against a running one-rank
    server: one request at a time of `prompt_len` tokens and one output token (a single
    engine step), its client seconds less the engine's step seconds meanwhile: the HTTP
    request in, the hand-over to the engine process, the token's detokenize and stream out
    (a one-token request's first token is its last). A P/D request pays it once per server
    leg (docs/simulator.md). The median of `reps` (one garbage collection or preemption in
    a rep is not the typical request). Prompts: random ids below `vocab`."""
    walls, engine = asyncio.run(_request_rows(base_url, prompt_len, reps, vocab))
    got = [max(w - e, 0.0) for w, e in zip(walls, engine)]
    return {"s": statistics.median(got), "reps": got, "engine_s": engine,
            "prompt_len": prompt_len}


def start_server(model_dir: str | None, port: int, args: list[str],
                 env: dict[str, str] | None = None, timeout: float = 600.0
                 ) -> tuple[subprocess.Popen, str]:
    """One `wideserve serve` on this machine (one rank); returns it and its base URL once
    /health answers."""
    import httpx
    cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve",
           *([model_dir] if model_dir else []), "--port", str(port), "--log-level", "warning",
           *args]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"serving calibration: the server on port {port} did not "
                               f"come up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_args(engine_kw: dict[str, Any], batches: list[int]) -> list[str]:
    """`wideserve serve` flags that match the in-process calibration engine's settings."""
    args = ["--load-format", str(engine_kw.get("load_format", "dummy")),
            "--dtype", str(engine_kw.get("dtype", "float32")),
            "--max-num-seqs", str(max(batches)), "--max-num-batched-tokens", "4096",
            "--max-prefill-tokens", "0",      # as the in-process engine (no cap)
            "--no-enable-prefix-caching"]
    if engine_kw.get("block_size", 32) is not None:
        args += ["--block-size", str(engine_kw.get("block_size", 32))]
    return args


def measure_serving(model_dir: str | None, inprocess: list[dict[str, float]],
                    prompt_len: int, output_len: int, engine_kw: dict[str, Any],
                    port: int = 8461, reps: int = 2, role_args: list[str] | None = None,
                    env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start one server on the calibration model, measure its decode step at the batches of
    the in-process rows, stop it; the serving table (serving_table) plus the raw rows.
    role_args: the deployment role's flags (a P/D decode instance's --kv-transfer-config:
    its connector works every step, handles or not), with `env` for them."""
    batches = [int(r["batch"]) for r in inprocess]
    proc, url = start_server(model_dir, port, server_args(engine_kw, batches)
                             + list(role_args or []), env)
    try:
        served = measure_served(url, batches, prompt_len, output_len, reps)
        request = measure_request(url, prompt_len)
    finally:
        stop_server(proc)
    return {**serving_table(inprocess, served), "served_rows": served,
            "request_s": request["s"], "request": request}
