"""Decode step time during a burst of arriving KV loads, with and without the per-step cap
(`max_new_kv_loads_per_step`), on the bundled V4 model in one process (loopback connector).

    python benchmarks/pd/admission_cap.py [--running 16] [--burst 64] [--prompt 400]

The decode engine runs `--running` requests; then `--burst` requests whose prompts were
prefilled on the prefill engine arrive at once. Reported per cap: the running requests'
inter-token latency while the burst is admitted (mean, p90, max step time), and the time
until every burst request has its first token.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
import torch

from wideserve.config import engine_config_from_kwargs
from wideserve.engine.engine_core import EngineCore
from wideserve.types.messages import EngineCoreRequest
from wideserve.disagg.loopback import LoopbackHub
from wideserve.worker.model_loader import load_model
from wideserve.types.sampling_params import SamplingParams


def _sp(n: int, kv: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=kv)


def _prefill(p: EngineCore, prompts: list[list[int]], tag: str) -> list[dict]:
    for i, pr in enumerate(prompts):
        p.add_request(EngineCoreRequest(f"{tag}{i}", pr, _sp(1, {"do_remote_decode": True})))
    handles: dict[str, dict] = {}
    while len(handles) < len(prompts):
        for out in p.step():
            if out.finished:
                handles[out.request_id] = out.kv_transfer_params
    return [handles[f"{tag}{i}"] for i in range(len(prompts))]


def run(cap: int, args, loaded) -> dict:
    hub = LoopbackHub()
    common = dict(max_num_seqs=args.running + args.burst, max_num_batched_tokens=4096,
                  kv_cache_memory=1 << 30)
    p = EngineCore(engine_config_from_kwargs(**common, kv_transfer_config={
        "kv_connector": "LoopbackConnector", "kv_role": "kv_producer", "engine_id": "P",
        "kv_lease_s": 600}), loaded, kv_hub=hub)
    d = EngineCore(engine_config_from_kwargs(**common, kv_transfer_config={
        "kv_connector": "LoopbackConnector", "kv_role": "kv_consumer", "engine_id": "D",
        "max_new_kv_loads_per_step": cap}), loaded, kv_hub=hub)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, args.prompt).tolist() for _ in range(args.running + args.burst)]
    handles = _prefill(p, prompts, "p")
    for i in range(args.running):
        d.add_request(EngineCoreRequest(f"run{i}", prompts[i], _sp(1000 - args.prompt, handles[i])))
    for _ in range(20):                          # the running batch reaches steady decode
        d.step()
    for i in range(args.running, len(prompts)):
        d.add_request(EngineCoreRequest(f"b{i}", prompts[i], _sp(4, handles[i])))
    start = time.perf_counter()
    steps, first = [], set()
    while len(first) < args.burst:
        t = time.perf_counter()
        outs = d.step()
        steps.append(time.perf_counter() - t)
        first |= {o.request_id for o in outs if o.request_id.startswith("b") and o.new_token_ids}
    admitted_s = time.perf_counter() - start
    s = np.array(steps)
    return {"cap": cap, "running": args.running, "burst": args.burst, "prompt": args.prompt,
            "steps": len(steps), "step_mean_ms": round(s.mean() * 1e3, 2),
            "step_p90_ms": round(float(np.percentile(s, 90)) * 1e3, 2),
            "step_max_ms": round(s.max() * 1e3, 2), "burst_first_tokens_s": round(admitted_s, 3),
            "max_loads_per_step": d.kv_connector.scheduler.stats.max_loads_started_per_step,
            "connector": d.kv_connector.scheduler.snapshot()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(engine_config_from_kwargs().load)
        for _ in range(args.rounds):            # alternate, so noise hits both alike
            for cap in (4, 0):
                print(json.dumps(run(cap, args, loaded)), flush=True)


if __name__ == "__main__":
    main()
