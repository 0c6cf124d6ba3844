"""`wideserve simulate`: the rack simulator (docs/simulator.md).

    wideserve simulate run MODEL_DIR --hardware gb300 --profile prof.json --dep 16 ...
    wideserve simulate sweep MODEL_DIR --hardware gb300 --profile prof.json --plot out.png
    wideserve simulate calibrate --out prof.json

The layout sweep is `simulate sweep`, not `wideserve plan`: `wideserve info --plan` already
means "memory plan", and two "plans" that answer different questions would confuse.
argparse only at module level: the simulator loads inside `run`.
"""
from __future__ import annotations

import argparse
import json
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="model directory with config.json")
    p.add_argument("--hardware", default="gb300",
                   help="h100, h200, b200, gb200, gb300, or a JSON file (a calibration "
                        "profile = this machine)")
    p.add_argument("--profile", required=True, help="calibration profile JSON (host costs)")
    p.add_argument("--weight-format", default=None, choices=("fp32", "bf16", "fp8", "fp4"),
                   help="dense weight format in device memory (default: the checkpoint's)")
    p.add_argument("--expert-format", default=None, choices=("fp32", "bf16", "fp8", "fp4"),
                   help="routed-expert weight format (default: the checkpoint's)")
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="requests per rank")
    p.add_argument("--mtp", type=int, nargs="+", default=[0], help="draft tokens k")
    p.add_argument("--acceptance", type=float, nargs="*", default=[0.8, 0.7, 0.6],
                   help="conditional acceptance per draft position")
    p.add_argument("--draw-acceptance", action="store_true",
                   help="draw each request's accepted drafts per step instead of using the "
                        "expected value (a finite batch lasts as long as its unluckiest "
                        "request)")
    p.add_argument("--sync", choices=("ring", "rd"), default="rd",
                   help="DP step-sync all-reduce: ring or recursive doubling")
    p.add_argument("--no-overlap", action="store_true", help="host and device in series")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf skew of target routing")
    p.add_argument("--draft-skew", type=float, default=0.0,
                   help="Zipf skew of draft-model routing")
    p.add_argument("--eplb-interval", type=int, default=None,
                   help="steps between EPLB rebalances (default: a quarter of --steps, so "
                        "a run sees several rebalances)")
    p.add_argument("--eplb-window", type=int, default=None,
                   help="steps of load recorded after each rebalance (default: a third of "
                        "the interval)")
    p.add_argument("--redundant", type=int, default=0,
                   help="redundant expert slots per layer (EPLB)")
    p.add_argument("--prefill-ranks", type=int, default=4,
                   help="GPUs per prefill instance")
    p.add_argument("--transfer", choices=("pull", "push"), default="push",
                   help="KV transfer: per-block pull or packed push")
    p.add_argument("--prefill-batch-tokens", type=int, default=0,
                   help="prompt tokens a prefill instance batches per step (0: one prompt at "
                        "a time)")
    p.add_argument("--max-kv-loads", type=int, default=None,
                   help="new KV loads admitted per decode step and rank")
    p.add_argument("--pd-host-cores", type=int, default=0,
                   help="P/D instances share one measured host of this many cores (a "
                        "single-machine deployment; 0: each instance on its own host)")
    p.add_argument("--workload", choices=("fixed", "agentic"), default="fixed",
                   help="fixed lengths or AgentX-style sessions")
    p.add_argument("--input-len", type=int, default=8192,
                   help="prompt tokens (fixed workload)")
    p.add_argument("--output-len", type=int, default=1024,
                   help="output tokens (fixed workload)")
    p.add_argument("--agentic-scale", type=float, default=1.0,
                   help="token-count scale of the agentic generator")
    p.add_argument("--steps", type=int, default=2000,
                   help="decode steps to simulate")
    p.add_argument("--price", type=float, default=0.0, help="$ per GPU-hour")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed (routing draws, noise, workload)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="rack simulator: run, sweep, calibrate")
    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="simulate one layout")
    _common(r)
    r.add_argument("--dep", type=int, default=16,
                   help="DEP size (decode ranks)")
    r.add_argument("--eplb", action="store_true",
                   help="enable EPLB")
    r.add_argument("--prefill-instances", type=int, default=0,
                   help="prefill instances (0: colocated)")
    s = sub.add_parser("sweep", help="sweep layouts, print and plot the Pareto frontier")
    _common(s)
    s.add_argument("--dep", type=int, nargs="+", default=[8, 16, 32],
                   help="DEP sizes to sweep")
    s.add_argument("--eplb", choices=("on", "off", "both"), default="both",
                   help="EPLB settings to sweep")
    s.add_argument("--prefill-instances", type=int, nargs="+", default=[0],
                   help="prefill instance counts to sweep")
    s.add_argument("--plot", default=None, help="PNG path for the frontier plot")
    c = sub.add_parser("calibrate", help="measure this machine with the engine, write a profile")
    c.add_argument("--model", default=None,
                   help="model directory (default: the DEP benchmark's many-expert config)")
    c.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8],
                   help="batch sizes the engine is measured at")
    c.add_argument("--threads", type=int, default=1,
                   help="torch threads while measuring")
    c.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                   help="rank counts the collectives are measured at (>= 2 each)")
    c.add_argument("--pd", action="store_true",
                   help="also measure P/D: one-rank prefill vs prompt length, NIXL loopback "
                        "transfer, per-KV-load admission cost")
    c.add_argument("--admission-model", default=None,
                   help="model directory whose KV layout the admission cost is measured on "
                        "(default: --model)")
    c.add_argument("--serving", action="store_true",
                   help="also measure the serving path's seconds per decode step: the model "
                        "behind one `wideserve serve` (engine process, IPC, API server, "
                        "detokenize, HTTP streaming) vs in-process; needs --model with a "
                        "tokenizer")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="the workload's sampling temperature the steps are measured with "
                        "(0: greedy; an OpenAI client that sends none gets 1.0, and random "
                        "sampling costs a step more than argmax)")
    c.add_argument("--out", required=True,
                   help="where to write the profile JSON")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.sim_command == "calibrate":
            return _calibrate(args)
        return _simulate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"wideserve simulate: error: {exc}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from wideserve.sim.calibrate import (DEFAULT_CONFIG, PDCalibration, calibrate,
                                         temp_model_dir, write_profile)
    if min(args.ranks) < 2:
        raise ValueError(f"--ranks: collectives need rank counts >= 2, got {args.ranks}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.serving and not (args.model and _has_tokenizer(args.model)):
        raise ValueError("--serving needs --model: a model directory with a tokenizer (the "
                         "serving path detokenizes what it streams)")
    model = args.model or temp_model_dir(DEFAULT_CONFIG)
    pd = PDCalibration(admission_model=args.admission_model) if args.pd else None
    write_profile(calibrate(model, args.batches, threads=args.threads,
                            ranks=tuple(args.ranks), pd=pd, serving=args.serving,
                            temperature=args.temperature), args.out)
    print(f"profile written to {args.out}")
    return 0


def _has_tokenizer(model: str) -> bool:
    from pathlib import Path
    d = Path(model)
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                           "tokenizer_config.json"))


def _base(args: argparse.Namespace):
    from wideserve.sim.eplb import EplbSettings, eplb_schedule
    from wideserve.sim.pd import PDSettings
    from wideserve.sim.simulator import Layout
    if args.prefill_batch_tokens < 0:
        raise ValueError("--prefill-batch-tokens must be >= 0")
    if args.pd_host_cores < 0:
        raise ValueError("--pd-host-cores must be >= 0 (0: each instance on its own host)")
    interval, window, warn = eplb_schedule(args.steps, args.eplb_interval, args.eplb_window)
    if warn and (args.eplb is True or args.eplb in ("on", "both")):
        print(warn, file=sys.stderr)
    return Layout(acceptance=tuple(args.acceptance), draw_acceptance=args.draw_acceptance,
                  sync_algo=args.sync,
                  overlap_host=not args.no_overlap, skew=args.skew, draft_skew=args.draft_skew,
                  eplb=EplbSettings(True, interval, window, args.redundant),
                  pd=PDSettings(prefill_ranks=args.prefill_ranks, transfer=args.transfer,
                                max_kv_loads_per_step=args.max_kv_loads,
                                prefill_batch_tokens=args.prefill_batch_tokens,
                                host_cores=args.pd_host_cores),
                  price_per_gpu_hour=args.price)


def _simulate(args: argparse.Namespace) -> int:
    from wideserve.sim import report, sweep
    from wideserve.sim.hardware import load_hardware, load_profile
    from wideserve.sim.model import load_model
    from wideserve.sim.simulator import Simulation
    from wideserve.sim.workload import agentic, fixed
    model = load_model(args.model)
    model.weight_format = args.weight_format or model.weight_format
    model.expert_format = args.expert_format or model.expert_format
    hw, prof = load_hardware(args.hardware), load_profile(args.profile)

    def make(lay):
        work = (agentic(scale=args.agentic_scale, seed=args.seed) if args.workload == "agentic"
                else fixed(args.input_len, args.output_len))
        return Simulation(model, hw, prof, lay, work, args.seed)

    eplb = {"on": [True], "off": [False], "both": [False, True]}
    grid = list(sweep.layouts(
        _base(args), args.dep if isinstance(args.dep, list) else [args.dep], args.batch,
        args.mtp, eplb[args.eplb] if isinstance(args.eplb, str) else [args.eplb],
        args.prefill_instances if isinstance(args.prefill_instances, list)
        else [args.prefill_instances]))
    results = sweep.run_sweep(make, grid, args.steps)
    if args.sim_command == "run":
        print("\n".join(report.describe(results[0], model, hw, prof)))
        return 0
    front = sweep.pareto(results)
    print("\n".join(sweep.table(results, front)))
    if args.plot:
        sweep.plot(results, front, args.plot)
        print(f"plot written to {args.plot}")
    print(json.dumps({"parameters": report.parameters(model, hw, prof)}, indent=1))
    return 0
