"""`simulate calibrate`: the expert-parallel MoE layer as the engine runs it, at n ranks.

A one-rank calibration cannot see what an MoE layer costs under expert parallelism: alone, a
rank runs the fused expert kernel on its own rows; at DEP n it runs the dispatcher instead
(layers/ep_dispatch.py: routing bookkeeping, fixed-capacity padded buffers, three gloo
all_to_all_single per layer, the grouped MLP over what arrives, the combine) and meets its
peers three times per layer. So this measures it directly: n processes placed as the engine
places its DEP ranks, each holding E / n experts of the calibrated model's shape in
`RoutedExperts` with the engine's `AllToAllDispatcher` (padded path, step header), run
step after step as a DEP forward runs them:

    begin_step(T); for each MoE layer: dense work, then the MoE layer on T tokens; finish_step

The dense work between two MoE layers is CPU work (1-thread matmuls) of the one-rank
engine's measured dense forward at T tokens over the layers (what a rank computes between two
exchanges), so a rank meets its peers after as much work as in the engine and its waits are
those of the engine's forward. Routing is uniform (each token's top-k distinct experts drawn
at random). Per T, per MoE layer (means over steps and ranks, wall seconds): `layer_s` the
layer's whole cost (wall between the end of the dense work and the layer's return),
`a2a_s` inside the exchanges (their own time plus waiting for the peer), `expert_s` in the
grouped MLP, and `step_s` the step header (`begin_step`) and closing (`finish_step`).
What the weights are does not matter (dummy values); their shape does.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

EP_TOKENS = (1, 4, 8, 16)         # tokens per rank the layer is measured at
EP_STEPS = 40                     # steps per size (after 5 warm-up steps)


def _work(a: Any, reps: int) -> None:
    for _ in range(reps):
        a @ a


def _matmul_unit(a: Any) -> float:
    """CPU seconds of one work unit (the minimum over the ranks: the same work everywhere)."""
    import torch
    import torch.distributed as dist
    start = time.thread_time()
    _work(a, 200)
    unit = torch.tensor([(time.thread_time() - start) / 200], dtype=torch.float64)
    dist.all_reduce(unit, op=dist.ReduceOp.MIN)
    return max(float(unit), 1e-7)


def ep_layer_worker(rank: int, world: int, port: int, shape: dict[str, Any], q: Any) -> None:
    """One rank of the measurement (spawned): see the module docstring. `shape`: experts,
    top_k, hidden, intermediate, layers, dense_tokens / dense_s (the one-rank dense
    forward's table), tokens (sizes to measure), max_tokens (the engine's max_num_seqs)."""
    import torch
    import torch.distributed as dist

    from wideserve.layers.ep_dispatch import AllToAllDispatcher, PaddedSteps
    from wideserve.layers.experts import RoutedExperts
    from wideserve.utils.threads import apply_engine_plan
    from wideserve.worker.decode_capture import capture_sizes
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    apply_engine_plan(None, rank, world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    E, k, d = shape["experts"], shape["top_k"], shape["hidden"]
    L = E // world
    group = dist.group.WORLD
    padded = PaddedSteps(capture_sizes(shape["max_tokens"], max_size=shape["max_tokens"]), k,
                         d, torch.float32, num_layers=shape["layers"])
    disp = AllToAllDispatcher(group, rank, world, L, torch.device("cpu"),
                              control_group=group, padded=padded)
    layers = []
    for _ in range(shape["layers"]):
        ex = RoutedExperts(E, d, shape["intermediate"], num_local_experts=L)
        torch.nn.init.normal_(ex.gate_up_proj, std=0.02)
        torch.nn.init.normal_(ex.down_proj, std=0.02)
        ex.requires_grad_(False)
        ex.expert_load = torch.zeros(E, dtype=torch.int64)     # as expert_shard sets it
        disp.register(ex)
        layers.append(ex)
    a = torch.randn(96, 96)
    unit = _matmul_unit(a)
    rng = torch.Generator().manual_seed(1000 + rank)
    out = {}
    with torch.no_grad():
        for T in shape["tokens"]:
            dense = float(np.interp(T, shape["dense_tokens"], shape["dense_s"]))
            reps = max(1, round(dense / shape["layers"] / unit))
            out[str(T)] = _ep_steps(disp, layers, T, k, d, a, reps, rng, shape["steps"])
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def _ep_steps(disp: Any, layers: list, T: int, k: int, d: int, a: Any, reps: int,
              rng: Any, steps: int) -> dict[str, float]:
    """`steps` lock-step steps of T tokens (after 5 warm-up steps); per-layer means over
    steps, averaged over ranks."""
    import torch
    import torch.distributed as dist
    x = torch.randn(T, d)
    w = torch.full((T, k), 1.0 / k)
    E = layers[0].num_experts
    tot = np.zeros(5)                   # layer, a2a, expert, step header+close, work cpu
    for s in range(5 + steps):
        ids = torch.rand(T, E, generator=rng).topk(k, dim=1).indices
        a0, e0 = disp.stats.a2a_s, disp.stats.expert_s
        t = time.perf_counter()
        disp.begin_step(T)
        head = time.perf_counter() - t
        layer = work = 0.0
        for ex in layers:
            c = time.thread_time()
            _work(a, reps)
            work += time.thread_time() - c
            t = time.perf_counter()
            ex(x, ids, w)
            layer += time.perf_counter() - t
        disp.forward_done()
        t = time.perf_counter()
        disp.finish_step()
        head += time.perf_counter() - t
        if s >= 5:
            tot += [layer, disp.stats.a2a_s - a0, disp.stats.expert_s - e0, head, work]
    n = len(layers) * steps
    means = torch.tensor([tot[0] / n, tot[1] / n, tot[2] / n, tot[3] / steps,
                          tot[4] / n], dtype=torch.float64)
    dist.all_reduce(means)
    means /= dist.get_world_size()
    return {"layer_s": float(means[0]), "a2a_s": float(means[1]),
            "expert_s": float(means[2]), "step_s": float(means[3]),
            "work_cpu_s": float(means[4])}


def _result(q: Any, procs: list, timeout_s: float) -> dict[str, Any]:
    """Rank 0's table; a clear error at once when a rank died rather than at the timeout."""
    import queue
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"EP calibration: a rank exited with code {dead[0]}")
    raise RuntimeError(f"EP calibration: no result in {timeout_s:.0f} s")


def spawn_ranks(target: Any, world: int, *args: Any) -> tuple[list[Any], Any]:
    """`world` spawned processes running target(rank, world, port, *args, queue) with a free
    loopback port for their process group, and the queue they answer on (this module's EP
    layer table and calibrate.py's collectives)."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, q


def measure_ep_layer(world: int, cfg: dict[str, Any], dense: dict[str, list[float]],
                     max_tokens: int, tokens: tuple[int, ...] = EP_TOKENS,
                     steps: int = EP_STEPS) -> dict[str, Any]:
    """The table (module docstring) at `world` ranks for the model config `cfg` (HF keys),
    given the one-rank dense forward table `dense` ({"tokens", "s"})."""
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts"))
    if experts % world:
        raise ValueError(f"EP calibration: {experts} experts do not split over {world} ranks")
    shape = {"experts": experts, "top_k": int(cfg["num_experts_per_tok"]),
             "hidden": int(cfg["hidden_size"]),
             "intermediate": int(cfg["moe_intermediate_size"]),
             "layers": int(cfg["num_hidden_layers"]), "dense_tokens": dense["tokens"],
             "dense_s": dense["s"], "max_tokens": max(max_tokens, max(tokens)),
             # up to the calibration's largest batch, which is always measured (the
             # table is held flat past its last point)
             "tokens": sorted({t for t in tokens if t < max(max_tokens, 1)}
                              | {max(max_tokens, 1)}), "steps": steps}
    procs, q = spawn_ranks(ep_layer_worker, world, shape)
    try:
        rows = _result(q, procs, 300.0)
    finally:
        for p in procs:
            p.join(timeout=60)
    ts = sorted(int(t) for t in rows)
    return {"tokens": [float(t) for t in ts],
            **{key: [rows[str(t)][key] for t in ts]
               for key in ("layer_s", "a2a_s", "expert_s", "step_s", "work_cpu_s")}}
