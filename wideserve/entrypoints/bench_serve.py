"""`wideserve bench serve --base-url URL`: benchmark any OpenAI-compatible server.

Runs one point per `--max-concurrency` value (a sweep), prints each point's metrics, and writes
the JSON (and, with --plot-dir, PNG plots). Ctrl-C stops the run and still writes the partial
results (a second Ctrl-C aborts at once).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from wideserve.entrypoints.bench_agentic import add_generator_arguments
from wideserve.utils.extras import MATPLOTLIB


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    g.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="random/shared-prefix only; agentic always uses chat")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for building prompts (default: the bundled model's)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "shared-prefix", "agentic"), default="random",
                   help="random token prompts, prompts sharing prefixes, or agentic session replay")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency point")
    g.add_argument("--prompts-per-concurrency", type=int, default=None,
                   help="num prompts = this x concurrency (InferenceX uses 10)")
    g.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens (shared-prefix: the suffix after the prefix)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L(1-r), L(1+r)]")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=4,
                   help="shared-prefix: distinct prefixes")
    g.add_argument("--ignore-eos", default=True, action=argparse.BooleanOptionalAction,
                   help="generate exactly the output length (default on)")
    g.add_argument("--seed", type=int, default=0, help="dataset seed")
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, nargs="+", default=[8],
                   help="one point per value (agentic: concurrent session trees)")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: as fast as concurrency allows)")
    g.add_argument("--num-warmups", type=int, default=None,
                   help="warmup requests per point (default 2 x concurrency)")
    g.add_argument("--num-gpus", type=int, default=1,
                   help="GPUs of the deployment, for per-GPU throughput")
    g = p.add_argument_group("agentic replay")
    g.add_argument("--trace-dir", default=None,
                   help="Weka traces to replay (default: generate with the --agentic-* knobs)")
    g.add_argument("--duration", type=float, default=60.0, help="profiling seconds per point")
    g.add_argument("--warmup-per-lane", type=int, default=10,
                   help="warmup requests each lane sends before profiling starts")
    g.add_argument("--trace-gap-cap", type=float, default=300.0,
                   help="longest think time replayed between two requests (s)")
    g.add_argument("--idle-cap", type=float, default=10.0,
                   help="when nothing is in flight, the next request fires within this (s)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply think times (1.0 = as recorded)")
    g.add_argument("--start-min", type=float, default=0.25,
                   help="a lane starts its first trace at a uniform fraction in [min, max]")
    g.add_argument("--start-max", type=float, default=0.75, help="see --start-min")
    g.add_argument("--min-output-tokens", type=int, default=1,
                   help="floor on each replayed request's max_tokens")
    g.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for in-flight requests after profiling ends")
    add_generator_arguments(p, prefix="agentic-")
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--plot-dir", default=None, help="write sweep and latency PNGs here")
    g.add_argument("--label", default=None, help="series label in plots")
    g.add_argument("--save-samples", action="store_true",
                   help="include per-request TTFT/TPOT/E2EL and pooled ITL in the JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _validate(args: argparse.Namespace) -> str | None:
    if any(c < 1 for c in args.max_concurrency):
        return "--max-concurrency values must be >= 1"
    if args.num_gpus < 1:
        return "--num-gpus must be >= 1"
    if args.request_rate <= 0:
        return "--request-rate must be > 0"
    if args.dataset == "agentic" and args.request_rate != float("inf"):
        return "--request-rate does not apply to agentic replay (closed loop)"
    if args.plot_dir and not MATPLOTLIB.installed():
        return MATPLOTLIB.message("--plot-dir")
    return None


def run(args: argparse.Namespace) -> int:
    error = _validate(args)
    if error:
        print(f"wideserve bench serve: error: {error}", file=sys.stderr)
        return 2
    import httpx

    results: dict[str, Any] = {}
    try:
        asyncio.run(_main(args, results))
    except httpx.TransportError as exc:       # nothing listening, a timeout, a reset
        print(f"wideserve bench serve: error: cannot reach --base-url {args.base_url} ({exc}):"
              f" start the server first (`wideserve serve`) or fix the URL", file=sys.stderr)
        if not results.get("points"):
            return 1
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"wideserve bench serve: error: {exc}", file=sys.stderr)
        if not results.get("points"):
            return 1
    if not results.get("points"):
        print("wideserve bench serve: stopped before any point ran; nothing written",
              file=sys.stderr)
        return 130
    _write(args, results)
    return 0


async def _main(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import httpx

    from wideserve.bench.client import ServeTarget, resolve_model
    from wideserve.bench.report import command_line, machine_info

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:                    # first Ctrl-C: stop; second: default
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)
        print("\ninterrupted: finishing with partial results (Ctrl-C again to abort)",
              file=sys.stderr)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):
        pass
    tokenizer, words = _tokenizer(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or await resolve_model(client, args.base_url, headers)
        endpoint = "chat" if args.dataset == "agentic" else args.endpoint
        target = ServeTarget(args.base_url, model, endpoint, args.api_key,
                             ignore_eos=args.ignore_eos, tokenizer=tokenizer)
        results.update(command=command_line(args, "serve"),
                       machine=machine_info(), base_url=args.base_url, model=model,
                       endpoint=endpoint, dataset=_dataset_info(args), num_gpus=args.num_gpus,
                       points=[], samples=[], interrupted=False)
        traces = _traces(args) if args.dataset == "agentic" else None
        if traces is not None:
            from wideserve.bench.agentic import trace_stats
            results["dataset"]["trace_stats"] = trace_stats(traces)
        for i, conc in enumerate(args.max_concurrency):
            if stop.is_set():
                break
            if traces is not None:
                point = await _agentic_point(client, target, traces, words, args, conc, stop)
            else:
                point = await _request_point(client, target, words, args, conc, i, stop)
            summary = point.summary(args.num_gpus)
            results["points"].append(summary)
            results["samples"].append({"label": f"c={conc}", **point.samples()})
            results["interrupted"] = stop.is_set()
            _print_point(summary)
        results["machine_end"] = machine_info()


def _tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    from wideserve.bench.datasets import WordVocab
    from wideserve.bench.report import BUNDLED_MODEL_DIR
    from wideserve.text.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(args.tokenizer or BUNDLED_MODEL_DIR)
    return tok, WordVocab(tok)


def _traces(args: argparse.Namespace) -> list[dict[str, Any]]:
    from wideserve.bench.agentic import generate_sessions, read_traces
    from wideserve.entrypoints.bench_agentic import generator_params
    if args.trace_dir:
        return read_traces(args.trace_dir)
    return generate_sessions(generator_params(args, "agentic-"), args.agentic_sessions,
                             args.agentic_seed)


def _dataset_info(args: argparse.Namespace) -> dict[str, Any]:
    keys = {"random": ("num_prompts", "prompts_per_concurrency", "input_len", "output_len",
                       "range_ratio", "ignore_eos", "seed", "request_rate"),
            "shared-prefix": ("num_prompts", "prompts_per_concurrency", "input_len",
                              "output_len", "prefix_len", "num_prefixes", "ignore_eos", "seed",
                              "request_rate"),
            "agentic": ("trace_dir", "duration", "warmup_per_lane", "trace_gap_cap", "idle_cap",
                        "time_scale", "start_min", "start_max", "min_output_tokens",
                        "agentic_preset", "agentic_scale", "agentic_sessions", "agentic_seed",
                        "agentic_context_cap", "agentic_min_osl", "agentic_block_size")}
    info = {k: getattr(args, k) for k in keys[args.dataset]}
    if "request_rate" in info:
        info["request_rate"] = str(info["request_rate"])
    return {"name": args.dataset, **info}


async def _request_point(client: Any, target: Any, words: Any, args: argparse.Namespace,
                         conc: int, index: int, stop: asyncio.Event) -> Any:
    from wideserve.bench.datasets import random_requests, shared_prefix_requests
    from wideserve.bench.serve import run_point
    n = args.prompts_per_concurrency * conc if args.prompts_per_concurrency else args.num_prompts
    warm = 2 * conc if args.num_warmups is None else args.num_warmups
    seed = args.seed * 1000 + index        # fresh prompts per point: no cross-point cache hits
    if args.dataset == "random":
        reqs = random_requests(warm + n, args.input_len, args.output_len, args.range_ratio,
                               seed, words=words)
    else:
        reqs = shared_prefix_requests(warm + n, args.num_prefixes, args.prefix_len,
                                      args.input_len, args.output_len, seed, words=words)
    return await run_point(client, target, reqs[warm:], reqs[:warm], conc, args.request_rate,
                           seed, stop, progress=not args.no_progress)


async def _agentic_point(client: Any, target: Any, traces: list, words: Any,
                         args: argparse.Namespace, conc: int, stop: asyncio.Event) -> Any:
    from wideserve.bench.agentic_replay import BlockText, Replayer, ReplayOptions
    from wideserve.bench.prometheus import scrape
    from wideserve.bench.serve import PointResult
    opts = ReplayOptions(conc, args.duration, args.warmup_per_lane, args.start_min,
                         args.start_max, args.trace_gap_cap, args.idle_cap, args.time_scale,
                         args.drain_timeout, args.min_output_tokens, args.seed)
    block = int(traces[0].get("block_size", 64))
    replayer = Replayer(client, target, traces, BlockText(words, args.seed, block), opts, stop)
    point = PointResult(conc, float("inf"))

    async def on_start() -> None:
        point.server_before = await scrape(client, target.base_url)

    await replayer.run(progress=not args.no_progress, on_start=on_start)
    point.server_after = await scrape(client, target.base_url)
    point.records = replayer.records
    point.wall_s = replayer.profile_seconds
    point.interrupted = stop.is_set()
    point.extra = {"sessions_started": replayer.sessions_started,
                   "sessions_completed": replayer.sessions_completed,
                   "warmup_requests": sum(r.phase == "warmup" for r in replayer.records)}
    return point


def _print_point(s: dict[str, Any]) -> None:
    def ms(d: dict[str, Any], k: str) -> str:
        return "-" if d.get(k) is None else f"{1e3 * d[k]:.1f}"
    inter = s["e2e_interactivity_tok_s_user"]
    srv = s.get("server") or {}
    hit = srv.get("prefix_cache_hit_rate")
    print(f"[c={s['max_concurrency']}] {s['completed']}/{s['num_requests']} ok, "
          f"{s['failed']} failed ({s['context_overflows']} overflow) | "
          f"req/s {s['request_throughput']:.2f}, out tok/s {s['output_throughput']:.1f}, "
          f"total tok/s {s['total_token_throughput']:.1f} | TTFT p50/p90/p99 ms "
          f"{ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p90')}/{ms(s['ttft_s'], 'p99')}, "
          f"TPOT p50 {ms(s['tpot_s'], 'p50')}, ITL p50 {ms(s['itl_s'], 'p50')} | "
          f"interactivity P50/P90 {inter['p50'] or 0:.1f}/{inter['p90'] or 0:.1f} tok/s/user | "
          f"prefix hit {'-' if hit is None else f'{100 * hit:.1f}%'} | "
          f"spec decode {'absent' if srv.get('spec_decode') is None else srv['spec_decode']}")


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if not results.get("points"):
        return
    samples = results.pop("samples", [])
    if args.save_samples:
        results["samples"] = samples
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {path}")
    if args.plot_dir:
        from wideserve.bench.plots import plot_latency, plot_sweep
        label = args.label or f"{results['model']} ({args.dataset})"
        stem = f"{args.dataset}"
        a = plot_sweep({label: results["points"]}, Path(args.plot_dir) / f"{stem}_sweep.png")
        b = plot_latency(samples, Path(args.plot_dir) / f"{stem}_latency.png", title=label)
        print(f"plots: {a} {b}")
