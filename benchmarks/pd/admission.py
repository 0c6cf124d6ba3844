"""Decode-side admission of one remote load for a long prompt on DeepSeek-V4-Flash's KV
layout (43 layers, block 256) or Qwen3-30B-A3B's (48 full-attention layers): what the engine,
the scheduler and the connector do on the host before the pull starts.

    python benchmarks/pd/admission.py [--tokens 855000] [--model v4-flash|qwen3-moe]
    python benchmarks/pd/admission.py --ab main --tokens 131072 855000 [--model ...]

  decode:   the engine's decode of the AddRequests message (engine/engine_ipc.py) as the
            front end encoded it (a msgpack int array, or int32 bytes where the tree sends them)
  create:   Request(...) from the decoded prompt, as EngineCore.add_request makes it
  checks:   what EngineCore.add_request and the P/D consumer check over the whole prompt: the
            id range, and the prompt digest a P/D handle is verified against (on the
            request's int32 buffer where it has one, else on the list, as before it had one)
  lookup:   prefix-cache lookup (hashes the prompt's 256-token blocks)
  allocate: allocate_slots with num_external_tokens (sliding groups: only the window's pages)
  plan:     plan_pages + descriptor_indices (int32 numpy, null sliding pages skipped)
  naive:    the same descriptors built the obvious way: a Python loop over every page of
            every group and layer, sliding history included, int64 lists
  admission = decode + create + checks + lookup + allocate + plan: the host cost of admitting
            it, all on the engine's loop between two steps of the running batch.
  done_max / done_total: once the KV has arrived, the decode steps that follow publish the
            prompt's blocks to the prefix cache (hash + cache_block): the largest host cost
            of one step (allocate_slots) over the next 64 steps, and their sum.
  step_max = max(admission, done_max): the most this request adds to any one step.
  frontend: the front end's encode of the message (another process; not on a step).
--colocated: a request prefilled on this engine instead (no digest, no plan; allocate = the
  first 2,048-token chunk's slots; done_* = its later prefill steps and 64 decode steps).
Times are the thread's CPU time (--clock wall: wall time).
The models are built on the meta device (no weights), only for their KV cache specs.

--ab REV: before/after in one run. REV's wideserve/ is exported (git archive) to a temporary
directory, and this script runs alternately against it and against this tree (fresh
processes, A B A B ...), one process per (tree, size, round); it prints the per-phase medians
of each tree and the ratio before/after.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import build_kv_cache_config
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.disagg.layout import cdiv, descriptor_indices, group_plans, plan_pages, region_bases
from wideserve.disagg.params import prompt_digest
from wideserve.engine import engine_ipc as ipc
from wideserve.types import request as request_mod
from wideserve.types.messages import EngineCoreRequest
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams

DONE_STEPS = 64
CHUNK = 2048                # --colocated: the scheduler's default token budget per step
# The thread's CPU time: on a shared, loaded machine wall time adds whatever the OS gave other
# processes meanwhile (tens of ms at a time), which is no cost of this code. --clock wall: the
# wall clock instead.
clock = time.thread_time
REPLAY_TOKENS = 2541        # --window-mode replay: V4.1-Flash's exact replay (docs/kv_cache.md)


REPO = Path(__file__).resolve().parents[2]
# Qwen3-30B-A3B (its config.json's attention and MoE shape).
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, max_position_embeddings=262144,
                 rope_theta=1e6, rms_norm_eps=1e-6, decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)


def qwen3_moe_specs() -> dict:
    from wideserve.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(QWEN3_MOE))
    return model.kv_cache_specs("auto")


def flash_specs() -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from models.v4_configs import FLASH
    from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from wideserve.models.deepseek_v4.config import DeepseekV4Config
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(FLASH))
    return model.kv_cache_specs("auto")


def naive_descriptors(kv_config, rows: list[list[int]], end: int, base: np.ndarray) -> np.ndarray:
    out: list[int] = []
    first = 0
    for g, row in zip(kv_config.groups, rows):
        regions = list(range(first, first + len(g.names)))
        first += len(g.names)
        for j in range(cdiv(end, g.block_size)):
            for r in regions:
                out.append(int(base[r]) + row[j])
    return np.array(out, dtype=np.int64)


def whole_prompt_checks(req: Request, digest: bool = True) -> str | None:
    """EngineCore.add_request's id range check and the consumer's prompt digest (a handle is
    verified against it); on the int32 buffer where the request has one (this tree)."""
    ids = req.prompt_array() if hasattr(req, "prompt_array") else req.prompt_token_ids
    lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) else (min(ids),
                                                                                    max(ids))
    assert 0 <= lo and hi < 1 << 30
    return prompt_digest(ids) if digest else None


def measure(n: int, model: str, repeats: int, naive: bool, window_mode: str = "keep",
            colocated: bool = False) -> dict:
    torch.set_num_threads(1)
    specs = flash_specs() if model == "v4-flash" else qwen3_moe_specs()
    cache = CacheConfig(block_size=256, num_blocks_override=cdiv(n, 256) * 4 + 64,
                        prefix_window_mode=window_mode)
    kv_config = build_kv_cache_config(specs, cache, SchedulerConfig(max_num_seqs=4))
    groups = group_plans(kv_config)
    base = region_bases([b.num_blocks for b in kv_config.buckets
                         for _ in range(b.num_slabs)])
    prompt = [(7 * i) % 120000 + 2 for i in range(n)]
    phases = ("frontend", "decode", "create", "checks", "lookup", "allocate", "plan",
              "admission", "done_max", "done_total", "step_max") + (("naive",) if naive else ())
    times: dict[str, list[float]] = {k: [] for k in phases}
    descs = naive_descs = 0
    encoder, decoder = ipc.make_encoder(), ipc.make_input_decoder()
    to_wire = getattr(ipc, "to_wire", lambda r: r)
    as_array = getattr(request_mod, "prompt_token_array", None)
    for rep in range(repeats):
        kv = KVCacheManager(kv_config, cache, n + 16 + DONE_STEPS,
                            replay_tokens=REPLAY_TOKENS if window_mode == "replay" else None)
        tf = clock()
        data = encoder.encode(ipc.AddRequests(requests=[to_wire(EngineCoreRequest(
            f"r{rep}", prompt, SamplingParams(max_tokens=1)))]))
        t0 = clock()
        core = ipc.decode_requests(decoder.decode(data))[0][0]
        td = clock()
        ids = core.prompt_token_ids
        # EngineCore.add_request of each tree: the array form where it has one, else a list.
        ids = as_array(ids) if as_array is not None else ids if type(ids) is list else list(ids)
        req = Request(core.request_id, ids, core.sampling_params)
        t1 = clock()
        whole_prompt_checks(req, digest=not colocated)
        t1b = clock()
        hit, num_hit = kv.get_computed_blocks(req)
        t2 = clock()
        if colocated:       # prefilled here: the first chunk's slots, no transfer plan
            assert kv.allocate_slots(req, CHUNK, hit, num_hit) is not None
            t3 = t4 = clock()
            idx = []
            done = chunk_steps(kv, req, n)
        else:
            assert kv.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) \
                is not None
            t3 = clock()
            rows = kv.block_ids(req.request_id)
            local, remote = plan_pages(groups, rows, rows, 0, n - 1)
            idx = descriptor_indices(groups, base, local)
            descriptor_indices(groups, base, remote)
            t4 = clock()
            done = load_done_steps(kv, req, n)
        for k, dt in zip(phases, (t0 - tf, td - t0, t1 - td, t1b - t1, t2 - t1b, t3 - t2,
                                  t4 - t3, t4 - t0, max(done), sum(done),
                                  max(t4 - t0, max(done)))):
            times[k].append(dt)
        descs = len(idx)
        if naive:
            # The naive build needs every page (no clipping): give sliding groups full rows.
            full_rows = [r if not g.is_sliding else list(range(1, cdiv(n - 1, g.block_size) + 1))
                         for g, r in zip(kv_config.groups, rows)]
            t5 = clock()
            naive_descs = len(naive_descriptors(kv_config, full_rows, n - 1, base))
            naive_descriptors(kv_config, full_rows, n - 1, base)    # local and remote sides
            times["naive"].append(clock() - t5)
        kv.free(req)
    return {"model": model, "window_mode": window_mode, "colocated": colocated, "tokens": n,
            "groups": len(kv_config.groups),
            "descriptors": descs, **({"naive_descriptors": naive_descs} if naive else {}),
            **{f"{k}_ms": round(float(np.median(v)) * 1e3, 2) for k, v in times.items()}}


def chunk_steps(kv: KVCacheManager, req: Request, n: int) -> list[float]:
    """--colocated: every later prefill step's allocate_slots (CHUNK tokens each), timed on
    its own, then DONE_STEPS decode steps."""
    out = []
    req.num_computed_tokens = CHUNK
    while req.num_computed_tokens < n + DONE_STEPS:
        step = min(CHUNK, n - req.num_computed_tokens) if req.num_computed_tokens < n else 1
        t = clock()
        assert kv.allocate_slots(req, step) is not None
        out.append(clock() - t)
        if req.num_computed_tokens >= n:
            req.append_output_token_ids([5])
        req.num_computed_tokens += step
    return out


def load_done_steps(kv: KVCacheManager, req: Request, n: int) -> list[float]:
    """The KV arrived: DONE_STEPS decode steps' allocate_slots, each timed on its own."""
    req.num_computed_tokens = n - 1
    out = []
    for _ in range(DONE_STEPS):
        t = clock()
        assert kv.allocate_slots(req, 1) is not None
        out.append(clock() - t)
        req.append_output_token_ids([5])
        req.num_computed_tokens += 1
    return out


def export_tree(rev: str, into: str) -> str:
    """REV's wideserve/ package under `into` (what the A side imports)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "wideserve"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def ab(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trees = {f"before ({args.ab})": export_tree(args.ab, tmp), "after (this tree)": str(REPO)}
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for n in args.tokens:
                for label, root in trees.items():      # alternate: A B A B ...
                    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
                    out = subprocess.run(
                        [sys.executable, __file__, "--tokens", str(n), "--model", args.model,
                         "--repeats", str(args.repeats), "--no-naive",
                         "--window-mode", args.window_mode, "--clock", args.clock]
                        + (["--colocated"] if args.colocated else []),
                        env=env, check=True, capture_output=True, text=True).stdout
                    results.setdefault((label, n), []).append(json.loads(out.splitlines()[-1]))
    phases = ("frontend", "decode", "create", "checks", "lookup", "allocate", "plan",
              "admission", "done_max", "done_total", "step_max")
    for n in args.tokens:
        rows = {}
        for label in trees:
            runs = results[(label, n)]
            rows[label] = {k: float(np.median([r[f"{k}_ms"] for r in runs])) for k in phases}
            print(json.dumps({"model": args.model, "window_mode": args.window_mode,
                              "colocated": args.colocated,
                              "tokens": n, "tree": label,
                              **{f"{k}_ms": round(v, 2) for k, v in rows[label].items()}}))
        before, after = rows.values()
        print(json.dumps({"model": args.model, "tokens": n, "speedup_before_over_after": {
            k: round(before[k] / after[k], 1) if after[k] else None for k in phases}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[855_000])
    ap.add_argument("--model", choices=("v4-flash", "qwen3-moe"), default="v4-flash")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive descriptor build")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="thread CPU time (default) or wall time")
    ap.add_argument("--colocated", action="store_true",
                    help="a request prefilled on this engine: no digest, no transfer plan; "
                         "after = its later 2,048-token prefill steps and 64 decode steps")
    ap.add_argument("--window-mode", choices=("keep", "replay"), default="keep",
                    help="CacheConfig.prefix_window_mode (replay: sliding groups uncached)")
    ap.add_argument("--ab", metavar="REV", help="before/after against git revision REV")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: processes per tree and size")
    args = ap.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.ab:
        ab(args)
        return
    for n in args.tokens:
        print(json.dumps(measure(n, args.model, args.repeats,
                                 not args.no_naive and not args.colocated, args.window_mode,
                                 args.colocated)))


if __name__ == "__main__":
    main()
