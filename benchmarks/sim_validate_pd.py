"""P/D held-out row of the simulator's validation (docs/simulator.md, table A).

Calibration, one rank, in-process (wideserve/sim/calibrate*.py): the bundled V4 tiny model's
decode step (host + forward) at batches 1, 2, 4 (least-disturbed of 3), its prefill seconds at three prompt lengths,
NIXL on loopback (per-transfer time, bytes/s) and the decode host's admission cost of one KV
load. From that alone the simulator predicts a fixed benchmark (N requests of I prompt / O
output tokens at concurrency C, from empty) on one prefill + one decode server.
Held out: the real servers (`wideserve serve` x 2 with NixlConnector, `wideserve router`,
WIDESERVE_KV_SECRET set, as the README's P/D tour runs them) measured by `wideserve bench
serve` with the same workload: output tokens/s and TTFT (median).
Calibrations bracket the held-out runs (C0 B0 C1 B1 ... Cn; the servers stay up, idle while
calibrating): round k predicts B_k from the mean of C_k and C_k+1, so a load that drifts
steadily over the minutes of a round cancels to first order. (The paired design, calibrate
then measure, is in results/sim_validate_pd_paired.json.)

    python benchmarks/sim_validate.py --parts pd
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
NIXL = ('{"kv_connector": "NixlConnector", "kv_role": "%s"}')
AGENTS = 2                  # NIXL agents the deployment keeps: one per server (1P + 1D)
BATCH_TOKENS = 2048         # the servers' --max-num-batched-tokens (the engine default)
# The held-out benchmark's requests carry no temperature (`wideserve bench serve`), so the
# servers sample at their default, 1.0: the calibration measures the same sampling.
TEMPERATURE = 1.0
# No prefill cap (`serve` measures one by default): the simulator's prefill instance batches
# prompts up to the token budget, as the engine does without one.
SERVER_KW = ["--max-num-seqs", "8", "--max-num-batched-tokens", str(BATCH_TOKENS),
             "--max-prefill-tokens", "0", "--log-level", "warning"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "wideserve.entrypoints.cli", *args]


def _wait(url: str, procs: list[subprocess.Popen], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


def _cluster_env() -> dict[str, str]:
    """The servers' environment: one thread, UCX on loopback, the shared KV secret (made
    once per process when none is set)."""
    os.environ.setdefault("WIDESERVE_KV_SECRET", secrets.token_hex(32))
    return dict(os.environ, OMP_NUM_THREADS="1", UCX_NET_DEVICES="lo", UCX_MODULES="^ib",
                PYTHONUNBUFFERED="1")


def start_cluster(base_port: int = 8411) -> tuple[list[subprocess.Popen], str]:
    env = _cluster_env()
    p, d, r = base_port, base_port + 1, base_port + 2
    procs = [subprocess.Popen(_cli("serve", "--port", str(p), *SERVER_KW, "--kv-transfer-config",
                                   NIXL % "kv_producer"), env=env),
             subprocess.Popen(_cli("serve", "--port", str(d), *SERVER_KW, "--kv-transfer-config",
                                   NIXL % "kv_consumer"), env=env)]
    try:
        for port in (p, d):
            _wait(f"http://127.0.0.1:{port}", procs)
        procs.append(subprocess.Popen(_cli("router", "--prefill", f"http://127.0.0.1:{p}",
                                           "--decode", f"http://127.0.0.1:{d}", "--port", str(r),
                                           "--log-level", "warning"), env=env))
        _wait(f"http://127.0.0.1:{r}", procs)
    except BaseException:
        stop_cluster(procs)
        raise
    return procs, f"http://127.0.0.1:{r}"


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def bench(url: str, w: dict[str, int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b.json"
        subprocess.run(_cli("bench", "serve", "--base-url", url, "--no-progress", "--dataset",
                            "random", "--endpoint", "completions", "--input-len",
                            str(w["input_len"]), "--output-len", str(w["output_len"]),
                            "--num-prompts", str(w["requests"]), "--max-concurrency",
                            str(w["concurrency"]), "--ignore-eos", "--output-json", str(out)),
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       stdout=subprocess.DEVNULL)
        pt = json.loads(out.read_text())["points"][0]
    if pt["failed"]:
        raise RuntimeError(f"P/D bench: {pt['failed']} requests failed: {pt['errors']}")
    return {"output_tok_s": pt["output_throughput"], "ttft_p50_s": pt["ttft_s"]["p50"],
            "ttft_mean_s": pt["ttft_s"]["mean"], "tpot_p50_s": pt["tpot_s"]["p50"],
            "duration_s": pt["duration_s"]}


def calibrate_pd(w: dict[str, int], serving: bool = True, agents: int = AGENTS):
    """The one-rank profile of the bundled model (host, forward, prefill, NIXL, admission;
    with `serving` the serving path's cost per step from one server of the same model set
    up as the deployment's decode instance,
    calibrate_pd.measure_serving). Repetitions are averaged, not minimised: the held-out
    benchmark measures a typical minute of this machine."""
    from wideserve.worker.model_loader import BUNDLED_MODEL
    from wideserve.sim.calibrate import measure_engine
    from wideserve.sim.calibrate_pd import (measure_admission, measure_nixl, measure_prefill,
                                            measure_serving, resident_agents)
    from wideserve.sim.validate import profile_from_rows
    model = str(BUNDLED_MODEL)
    kw = {"load_format": "auto", "dtype": "auto", "block_size": None}
    i = w["input_len"]
    # the decode step, the prefill and the served decode step as they run beside the
    # deployment's resident NIXL agents (one per server: 1P + 1D). The served step in
    # particular: a served engine waits for its API server between steps, and the OS
    # schedules a thread that sleeps and wakes differently from one that computes without
    # pause (the in-process rows) beside the agents' polling threads.
    with resident_agents(agents):
        rows = measure_engine(model, [1, 2, w["concurrency"]], w["input_len"], 24, kw,
                              reps=3, keep="mean", temperature=TEMPERATURE)
        prefill = measure_prefill(model, [i // 2, i, 2 * i], kw, keep="mean",
                                  temperature=TEMPERATURE)
        # the served step of a server configured as the deployment's decode instance (its
        # KV connector polls every step), alone: plain requests, no prefill peer
        served = (measure_serving(None, rows, w["input_len"], 24, kw,
                                  role_args=["--kv-transfer-config", NIXL % "kv_consumer"],
                                  env=_cluster_env()) if serving else None)
    prof = profile_from_rows(rows)
    if served is not None:
        prof.host["serving"] = served
    # always-runnable threads the calibration ran beside: the engine's own (the agents'
    # progress threads sleep between events since kv_progress_poll_us; before, each spun)
    prof.pd = {"prefill": prefill, "resident_threads": 1,
               "nixl": measure_nixl(),
               "admission": measure_admission(model, [i // 2, i, 2 * i], block_size=64)}
    return prof


def predict_pd(prof, w: dict[str, int], served: bool = True) -> dict[str, Any]:
    from wideserve.worker.model_loader import BUNDLED_MODEL
    from wideserve.sim.model import load_model
    from wideserve.sim.pd import PDSettings
    from wideserve.sim.simulator import Layout, Simulation
    from wideserve.sim.workload import fixed
    m = load_model(BUNDLED_MODEL)
    lay = Layout(dep=1, batch=w["concurrency"], overlap_host=False, jitter=False, served=served,
                 pd=PDSettings(prefill_instances=1, prefill_ranks=1, transfer="push",
                               prefill_batch_tokens=BATCH_TOKENS,
                               host_cores=len(os.sched_getaffinity(0))))
    work = itertools.islice(fixed(w["input_len"], w["output_len"]), w["requests"])
    sim = Simulation(m, prof.as_hardware(), prof, lay, work, steady=False)
    r = sim.run_to_end()
    tokens = w["requests"] * w["output_len"]
    return {"output_tok_s": tokens / r.seconds, "ttft_p50_s": r.ttft_p50_s,
            "step_ms": r.step_ms, "parts_ms": r.breakdown_ms, "seconds": r.seconds}


def pd_repredict(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved P/D rounds predicted again by the current model from each round's own saved
    calibration (engine rows, serving table, prefill, NIXL, admission); measurements kept."""
    from wideserve.sim.validate import profile_from_rows
    w, out = saved["workload"], []
    for r in saved["rounds"]:
        prof = profile_from_rows(r["engine_rows"])
        if r["host"].get("serving"):
            prof.host["serving"] = r["host"]["serving"]
        # rounds saved before the profile recorded it: the design's resident agents + engine
        prof.pd = {"resident_threads": saved.get("resident_agents", 0) + 1,
                   **r["profile_pd"]}
        pred = predict_pd(prof, w)
        # the ablation of a served request's latency per leg (docs/simulator.md, session 16)
        bare = copy.deepcopy(prof)
        if bare.host.get("serving"):
            bare.host["serving"]["request_s"] = 0.0
        out.append({**r, "predicted": pred, "previous_prediction": r["predicted"],
                    "predicted_without_serving": predict_pd(prof, w, served=False),
                    "predicted_without_request_latency": predict_pd(bare, w)})
        print(f"P/D round {r['round']}: tok/s pred {pred['output_tok_s']:.1f} (was "
              f"{r['predicted']['output_tok_s']:.1f}) meas {r['measured']['output_tok_s']:.1f}"
              f"  TTFT pred {1e3 * pred['ttft_p50_s']:.0f} ms (was "
              f"{1e3 * r['predicted']['ttft_p50_s']:.0f}) meas "
              f"{1e3 * r['measured']['ttft_p50_s']:.0f} ms", flush=True)
    return {"workload": w, "rounds": out}


def mean_profile(a, b):
    """The mean of two calibrations of the same shapes (engine rows per batch, prefill
    table): a calibration taken before a held-out run and one taken after it bracket the
    run, so a load that drifts steadily through them cancels to first order."""
    from wideserve.sim.validate import profile_from_rows
    rows = []
    for ra, rb in zip(a.ops["engine_rows"], b.ops["engine_rows"]):
        rows.append({k: (ra[k] + rb[k]) / 2 for k in ra})
    prof = profile_from_rows(rows)
    if a.host.get("serving"):
        prof.host["serving"] = a.host["serving"]
    pa, pb = a.pd["prefill"], b.pd["prefill"]
    prof.pd = {**b.pd, "prefill": {"tokens": pa["tokens"],
                                   "s": [(x + y) / 2 for x, y in zip(pa["s"], pb["s"])]}}
    return prof


def pd_rounds(w: dict[str, int], rounds: int, agents: int = AGENTS) -> dict[str, Any]:
    """Calibrations bracket the held-out runs: C0 B0 C1 B1 ... C_n; round k predicts B_k
    from the mean of C_k and C_k+1 (mean_profile). The serving loop (a quantity of one
    run, drift-free) is measured in C0 only and carried. The held-out cluster is up only
    for its own run (started, warmed, measured, stopped): its two servers' NIXL agents poll
    a core each even while idle (docs/simulator.md), so a calibration taken while it is up
    would run beside the deployment's agents AND the resident ones that stand in for them."""
    out = []
    cals = [calibrate_pd(w, agents=agents)]
    for k in range(rounds):
        procs, url = start_cluster()
        try:
            bench(url, {**w, "requests": 2 * w["concurrency"]})      # warm-up
            load = os.getloadavg()[0]
            meas = bench(url, w)
        finally:
            stop_cluster(procs)
        nxt = calibrate_pd(w, serving=False, agents=agents)
        nxt.host["serving"] = cals[0].host["serving"]
        cals.append(nxt)
        prof = mean_profile(cals[k], cals[k + 1])
        pred, unserved = predict_pd(prof, w), predict_pd(prof, w, served=False)
        before, after = predict_pd(cals[k], w), predict_pd(cals[k + 1], w)
        out.append({"round": k, "load_1min": load, "load_end": os.getloadavg()[0],
                    "predicted": pred, "predicted_without_serving": unserved,
                    "predicted_from_before": before, "predicted_from_after": after,
                    "measured": meas, "profile_pd": prof.pd,
                    "host": {x: prof.host[x] for x in ("base_s", "per_request_s",
                                                       "serving")},
                    "engine_rows": prof.ops["engine_rows"],
                    "engine_rows_before": cals[k].ops["engine_rows"],
                    "engine_rows_after": cals[k + 1].ops["engine_rows"]})
        print(f"P/D round {k}: load {load:.1f}  tok/s pred {pred['output_tok_s']:.1f} "
              f"(before {before['output_tok_s']:.1f}, after {after['output_tok_s']:.1f}) "
              f"meas {meas['output_tok_s']:.1f}  TTFT p50 pred "
              f"{1e3 * pred['ttft_p50_s']:.0f} ms (before {1e3 * before['ttft_p50_s']:.0f},"
              f" after {1e3 * after['ttft_p50_s']:.0f}) meas "
              f"{1e3 * meas['ttft_p50_s']:.0f} ms  step pred {pred['step_ms']:.0f} ms "
              f"meas TPOT {1e3 * meas['tpot_p50_s']:.0f} ms", flush=True)
    return {"workload": w, "rounds": out, "design": "bracketed: C0 B0 C1 B1 ... Cn",
            "resident_agents": agents}
