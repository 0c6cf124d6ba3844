"""`wideserve simulate calibrate`: measure this machine with the engine's own code, write a profile.

What is measured (all with the thread count given, one rank):
- engine steps: the real engine (`LLM`, in-process, one rank) decodes batches of B requests;
  from its step timer, per step: host = schedule + prepare + sample + output, and forward.
  Host cost = base + per_request * B (least squares over the batches, our own measurements).
- experts: `RoutedExperts.grouped_mlp` (the op the expert-parallel path runs) with A active
  experts of r rows each; per active expert = (t(A=8) - t(A=1)) / 7 at each r.
  dense_forward(B) = forward(B) - the experts' share predicted from that table (all local).
- host jitter: durations of a fixed small host task, minus their median (scheduling noise).
- collectives: torch.distributed gloo all_reduce (16 bytes) at 2 and 4 ranks, and
  all_to_all_single at several sizes at 2 ranks -> alpha (latency) and bytes/s (fit); and
  the lock-step meeting: ranks alternating a fixed piece of host work with a tiny
  all_to_all, the mean seconds per exchange vs the work between (_lockstep_meetings).
- memory bandwidth (a large copy) and fp32 matmul FLOP/s.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wideserve.sim.calibrate_pd import step_totals
from wideserve.sim.hardware import Profile

# The default calibration model: benchmarks/dep_scaling.py's many-expert Qwen3-MoE (dummy
# weights), small enough for a 2-core machine, with enough experts for EP to matter.
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
}


def _times(fn, reps: int) -> list[float]:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def _median_time(fn, reps: int) -> float:
    return statistics.median(_times(fn, reps))


def measure_experts(hidden: int, inter: int, rows: list[int], reps: int = 20) -> dict[str, Any]:
    import torch

    from wideserve.layers.experts import RoutedExperts
    ex = RoutedExperts(8, hidden, inter)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.02)
    torch.nn.init.normal_(ex.down_proj, std=0.02)
    out = []
    with torch.no_grad():
        for r in rows:
            t = {}
            for a in (1, 8):
                x = torch.randn(a * r, hidden)
                ids = torch.arange(a).repeat_interleave(r)
                t[a] = _median_time(lambda: ex.grouped_mlp(x, ids), reps)
            out.append(max((t[8] - t[1]) / 7, 1e-7))
    return {"rows": rows, "s": out, "hidden": hidden, "intermediate": inter}


def measure_engine(model_dir: str, batches: list[int], prompt_len: int, output_len: int,
                   extra: dict[str, Any] | None = None, reps: int = 1, keep: str = "min",
                   temperature: float = 0.0) -> list[dict[str, float]]:
    """Per batch size B: host, forward and expert seconds per *decode* step of the real
    engine: two runs of B requests that differ only in output length; the difference of the
    step timer's totals over the difference in steps leaves the prefill out. With reps > 1,
    keep="min" takes the least-disturbed short run and the least-disturbed long run (what the
    work costs: other processes' preemptions only add time; the least-disturbed *pair*
    could pair a delayed short run with a quiet long one and come out below zero),
    keep="mean" averages the pairs (what a typical minute of this machine gives, the quantity
    a held-out benchmark under the same load measures).
    temperature: the workload's sampling (0: greedy; a served benchmark that sends none gets
    the server's default, 1.0, and random sampling costs a decode step more than argmax)."""
    if keep not in ("min", "mean"):
        raise ValueError(f"keep must be min or mean, got {keep!r}")
    from wideserve import LLM
    kw = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, block_size=32,
              max_num_seqs=max(batches), max_num_batched_tokens=4096,
              kv_cache_memory=256 << 20, enable_prefix_caching=False)
    kw.update(extra or {})
    llm = LLM(model_dir, **kw)
    clock = _time_experts(llm.engine.model)
    rows = []
    try:
        rng = np.random.default_rng(7)
        _generate(llm, rng, 1, prompt_len, 4)                     # warm-up
        for b in batches:
            pairs = [(_generate(llm, rng, b, prompt_len, 4, clock, temperature),
                      _generate(llm, rng, b, prompt_len, 4 + output_len, clock, temperature))
                     for _ in range(reps)]
            if keep == "min":
                pairs = [(min((p[0] for p in pairs), key=_step_cost),
                          min((p[1] for p in pairs), key=_step_cost))]
            steps = pairs[0][1]["steps"] - pairs[0][0]["steps"]
            rows.append({"batch": b, "steps": steps,
                         **{k: float(np.mean([(long[k] - short[k]) / steps
                                              for short, long in pairs]))
                            for k in pairs[0][1] if k != "steps"}})
    finally:
        llm.shutdown()
    return rows


def _step_cost(run: dict[str, float]) -> float:
    return run["host"] + run["forward"]


def _generate(llm: Any, rng: np.random.Generator, batch: int, prompt_len: int,
              max_tokens: int, clock: list[float] | None = None, temperature: float = 0.0
              ) -> dict[str, float]:
    """Step-timer totals (and expert seconds) of one generate call."""
    from wideserve import SamplingParams
    def totals() -> dict[str, float]:
        return step_totals(llm) | {"experts": clock[0] if clock else 0.0,
                                   "cpu": time.process_time(), "wall": time.perf_counter()}
    before = totals()
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rng.integers(2, 500, prompt_len).tolist()}
                  for _ in range(batch)], sp, use_tqdm=False)
    after = totals()
    return {k: after[k] - before[k] for k in after}


def _time_experts(model: Any) -> list[float]:
    """Seconds spent inside the routed experts (forward hooks on every RoutedExperts):
    the engine's own op, timed where it runs, so the rest of the forward is known."""
    from wideserve.layers.experts import RoutedExperts
    clock, start = [0.0], [0.0]

    def pre(*_: Any) -> None:
        start[0] = time.perf_counter()

    def post(*_: Any) -> None:
        clock[0] += time.perf_counter() - start[0]
    for mod in model.modules():
        if isinstance(mod, RoutedExperts):
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    return clock


def host_fit(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(base, per_request) by least squares over the measured batches."""
    b = np.array([r["batch"] for r in rows], dtype=float)
    h = np.array([r["host"] for r in rows])
    if len(b) < 2:
        return float(h[0]), 0.0
    slope, icpt = np.polyfit(b, h, 1)
    return float(max(icpt, 0.0)), float(max(slope, 0.0))


def cpu_share(rows: list[dict[str, float]]) -> float:
    """CPU seconds the in-process engine (one thread) got per wall second of its decode steps:
    the share of a core the machine's load left it while the steps were measured."""
    cpu, wall = sum(r.get("cpu", 0.0) for r in rows), sum(r.get("wall", 0.0) for r in rows)
    return min(cpu / wall, 1.0) if cpu > 0 and wall > 0 else 1.0


def measure_jitter(samples: int = 3000) -> list[float]:
    a = np.random.default_rng(0).random(40_000)
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        np.sort(a)
        ts.append(time.perf_counter() - t)
    return [float(x) for x in ts]


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], q: Any) -> None:
    import torch
    import torch.distributed as dist

    from wideserve.utils.threads import apply_engine_plan
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Placed as the engine places its DEP ranks (one per core when they fit, OMP_NUM_THREADS
    # threads each): where a blocked rank waits to be woken is part of what is measured.
    apply_engine_plan(None, rank, world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    small = torch.zeros(4, dtype=torch.int32)
    ar = _times(lambda: dist.all_reduce(small), 200)
    tiny = torch.zeros(2 * world, dtype=torch.int32)
    tiny_out = torch.empty_like(tiny)
    a2a_small = _times(lambda: dist.all_to_all_single(tiny_out, tiny), 200)
    a2a = []
    for n in sizes:
        x = torch.zeros(n // 4 * world, dtype=torch.float32)
        y = torch.empty_like(x)
        a2a.append(_median_time(lambda: dist.all_to_all_single(y, x), 20))
    meet = _lockstep_meetings(world, tiny, tiny_out)
    dist.destroy_process_group()
    if rank == 0:
        q.put({"meeting": meet,
               "allreduce_s": statistics.median(ar), "allreduce_mean_s": statistics.mean(ar),
               "alltoall_s": a2a, "alltoall_small_mean_s": statistics.mean(a2a_small),
               "alltoall_small_median_s": statistics.median(a2a_small)})


# CPU seconds of host work between two collectives: around a DEP forward's (a few ms of
# forward over 3 exchanges per MoE layer), where the wait changes regime on a loaded machine
# (short work finishes within the slice a woken rank is given; longer work gets preempted).
MEETING_SEGMENTS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3)


def _lockstep_meetings(world: int, send: Any, recv: Any, meetings: int = 200
                       ) -> dict[str, list[float]]:
    """Lock-step ranks: a fixed piece of host work (1-thread matmuls) then a tiny
    all_to_all, repeated, as a DEP forward alternates compute and exchanges. Per amount of
    work (CPU seconds, thread_time: what the work costs, however long the OS took to run
    it), the mean wall seconds a rank spends inside the collective (averaged over the
    ranks): the gloo call itself plus waiting for the slowest peer's preemptions and for the
    OS to wake the blocked rank - what one exchange costs a forward on this machine under
    its current load. Means, not medians: the step time is a sum, so rare long waits
    count."""
    import torch
    import torch.distributed as dist
    a = torch.randn(96, 96)
    start = time.thread_time()
    for _ in range(200):
        a @ a
    unit = torch.tensor([(time.thread_time() - start) / 200], dtype=torch.float64)
    dist.all_reduce(unit, op=dist.ReduceOp.MIN)        # the same work on every rank
    cpu_s, wall_s, wait_s = [], [], []
    for seg in MEETING_SEGMENTS_S:
        n = max(1, round(seg / float(unit)))
        cpu = work = wait = 0.0
        for _ in range(meetings):
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                a @ a
            c1, t1 = time.thread_time(), time.perf_counter()
            dist.all_to_all_single(recv, send)
            cpu += c1 - c0
            work += t1 - t0
            wait += time.perf_counter() - t1
        tot = torch.tensor([cpu, work, wait], dtype=torch.float64) / meetings
        dist.all_reduce(tot)
        cpu_s.append(float(tot[0]) / world)
        wall_s.append(float(tot[1]) / world)
        wait_s.append(float(tot[2]) / world)
    return {"segment_cpu_s": cpu_s, "segment_wall_s": wall_s, "s": wait_s}


def measure_collectives(world: int, sizes: list[int]) -> dict[str, Any]:
    from wideserve.sim.calibrate_ep import spawn_ranks
    procs, q = spawn_ranks(_collective_worker, world, sizes)
    out = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return out


def alltoall_fit(sizes: list[int], times: list[float], world: int) -> dict[str, float]:
    """t = (n-1) alpha + (n-1)/n * bytes_sent / beta; bytes_sent = size * world."""
    x = np.array([s * world * (world - 1) / world for s in sizes], dtype=float)
    slope, icpt = np.polyfit(x, np.array(times), 1)
    return {"alpha_s": float(max(icpt, 1e-7)) / (world - 1),
            "bytes_per_s": float(1 / max(slope, 1e-15))}


def measure_machine() -> tuple[float, float]:
    import torch
    big = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    copy = _median_time(lambda: dst.copy_(big), 5)
    a = torch.randn(512, 512)
    mm = _median_time(lambda: a @ a, 10)
    return 2 * big.numel() / copy, 2 * 512 ** 3 / mm


def calibrate(model_dir: str, batches: list[int], prompt_len: int = 32, output_len: int = 24,
              threads: int = 1, ranks: tuple[int, ...] = (2, 4),
              pd: "PDCalibration | None" = None,
              engine_kw: dict[str, Any] | None = None, serving: bool = False,
              temperature: float = 0.0) -> Profile:
    """`ranks`: the rank counts the collectives are measured at (the all-to-all fit and the
    all-reduce latency come from the smallest); `pd`: also measure what P/D needs;
    `serving`: also the serving path's seconds per step and a request's latency outside
    the steps (one `wideserve serve` of the same model at the same batches; the model needs
    a tokenizer); `temperature`: the workload's sampling, for the in-process steps."""
    import torch
    if not ranks or min(ranks) < 2:
        raise ValueError(f"--ranks: collectives need rank counts >= 2, got {list(ranks)}")
    torch.set_num_threads(threads)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    hidden, inter = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    experts = measure_experts(hidden, inter, [1, 2, 4, 8, 16, 32, 64])
    with _beside_agents(pd):
        engine = measure_engine(model_dir, batches, prompt_len, output_len, engine_kw,
                                temperature=temperature)
    base, per_req = host_fit(engine)
    dense = _dense_rows(engine)
    host_extra = {}
    if serving:
        from wideserve.sim.calibrate_pd import measure_serving
        host_extra["serving"] = measure_serving(model_dir, engine, prompt_len, output_len,
                                                engine_kw or {})
    sizes = [4096, 65536, 1 << 20]
    ranks = tuple(sorted(set(ranks)))
    coll = {str(w): measure_collectives(w, sizes) for w in ranks}
    w0 = ranks[0]
    c0 = coll[str(w0)]
    from wideserve.sim.calibrate_ep import measure_ep_layer
    experts_total = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    # the dense work between MoE layers in CPU seconds (what a DEP rank computes there)
    share = cpu_share(engine)
    dense_cpu = {"tokens": dense["tokens"], "s": [share * x for x in dense["s"]]}
    ep = {str(w): measure_ep_layer(w, cfg, dense_cpu, max(batches)) for w in ranks
          if experts_total and experts_total % w == 0}
    fit = alltoall_fit(sizes, c0["alltoall_s"], w0)
    mem, flops = measure_machine()
    jit = measure_jitter()
    return Profile(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"{threads} thread(s), load {os.getloadavg()[0]:.2f}",
        host={"base_s": base, "per_request_s": per_req, "per_token_s": 0.0, "jitter_s": jit,
              "cpu_share": cpu_share(engine), **host_extra},
        collectives={"allreduce_s": {w: c["allreduce_s"] for w, c in coll.items()},
                     # a ring all-reduce of a tiny message: 2(n-1) latencies
                     "allreduce_alpha_s": c0["allreduce_s"] / (2 * (w0 - 1)),
                     "allreduce_mean_s": {w: c["allreduce_mean_s"] for w, c in coll.items()},
                     # alpha: the median of a tiny exchange, measured directly (the
                     # intercept of the size fit is noise-dominated on a loaded machine)
                     "alltoall": {**fit, "alpha_s": c0["alltoall_small_median_s"] / (w0 - 1),
                                  "ranks": w0, "sizes": sizes, "s": c0["alltoall_s"],
                                  "alpha_mean_s": c0["alltoall_small_mean_s"] / (w0 - 1),
                                  "alpha_median_s": c0["alltoall_small_median_s"] / (w0 - 1)},
                     # mean seconds per exchange of lock-step ranks vs the CPU seconds
                     # of host work between
                     "meeting": {w: c["meeting"] for w, c in coll.items()},
                     # the engine's EP MoE layer at n ranks vs tokens per rank
                     # (calibrate_ep.py): what a DEP step's MoE layers cost here
                     "ep_layer": ep},
        ops={"expert": experts, "dense_forward": dense, "engine_rows": engine},
        mem_bytes_per_s=mem, flops_fp32=flops,
        sources={"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "model": str(model_dir)},
        pd=measure_pd(model_dir, pd, engine_kw, temperature) if pd else {})


@dataclass(slots=True)
class PDCalibration:
    """What `calibrate --pd` measures (calibrate_pd.py)."""
    prefill_lengths: list[int] = field(default_factory=lambda: [64, 256, 512])
    admission_model: str | None = None      # KV layout for the admission cost (default: model)
    admission_tokens: list[int] = field(default_factory=lambda: [256, 4096, 32768, 131072])
    # NIXL agents the deployment keeps on this host (one per server: 1 prefill + 1 decode),
    # alive while the decode step and the prefill are measured
    resident_agents: int = 2


def _beside_agents(pd: PDCalibration | None) -> Any:
    """With `pd`: the deployment's resident NIXL agents alive while steps are measured
    (calibrate_pd.resident_agents); without: nothing."""
    if pd is None or pd.resident_agents <= 0:
        return contextlib.nullcontext()
    from wideserve.sim.calibrate_pd import resident_agents
    return resident_agents(pd.resident_agents)


def measure_pd(model_dir: str, pd: PDCalibration, engine_kw: dict[str, Any] | None,
               temperature: float = 0.0) -> dict[str, Any]:
    from wideserve.sim.calibrate_pd import measure_admission, measure_nixl, measure_prefill
    with _beside_agents(pd):
        prefill = measure_prefill(model_dir, pd.prefill_lengths, engine_kw,
                                  temperature=temperature)
    return {"prefill": prefill,
            "nixl": measure_nixl(),
            "admission": measure_admission(pd.admission_model or model_dir,
                                           pd.admission_tokens)}


def _dense_rows(engine: list[dict[str, float]]) -> dict[str, list[float]]:
    """forward(B) minus the time measured inside the routed experts."""
    return {"tokens": [float(r["batch"]) for r in engine],
            "s": [max(r["forward"] - r["experts"], 1e-6) for r in engine]}


def write_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=1))


def temp_model_dir(config: dict[str, Any]) -> str:
    d = tempfile.mkdtemp(prefix="wideserve-sim-")
    (Path(d) / "config.json").write_text(json.dumps(config))
    return d
