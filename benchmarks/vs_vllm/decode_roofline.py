"""Batched decode as a fraction of the machine's memory-bandwidth roofline (issue 24).

  python benchmarks/vs_vllm/decode_roofline.py MODEL [--batch 64] [--threads 2] [--out X.jsonl]

In one process: (1) the memory bandwidth of this machine, measured with torch (the fastest of
a few read-only passes - `sum`, `dot`, a matrix-vector product - over a float32 buffer much
larger than the caches, and a copy, counted as read + write), best of a few repeats, before
and again after the decode run, the higher of the two taken (`read_gbs_before`,
`read_gbs_after`: a shared host's bandwidth moves while the run goes); (2) a wideserve offline run of `--batch` prompts x
`--input-len` token ids -> `--output-len` tokens (greedy, EOS ignored), whose pure decode
steps (every request computes one token) are timed by the engine's own StepTimer;
(3) the bytes one such decode step must move from memory:
  - dense weights (attention projections, norms, router, LM head) once;
  - the routed experts' weights times the experts the step actually activates (counted
    with a forward hook on every router in one extra, untimed decode step);
  - the embedding rows of the batch's tokens;
  - the KV cache read: every request's context (input + tokens so far, averaged over the
    decode steps) x bytes per token per layer.
The decode roofline is bytes / read bandwidth; the achieved fraction is that time over the
measured median decode step. At one thread the same is also given on the thread's CPU time
(`*_cpu`: the read bandwidth and the step both timed on it), which a shared machine's load
does not inflate (wall-clock steps at load 10-20 on 2 cores were 2-3x their CPU time, while
the best-of-5 bandwidth is not). Beside it, the compute floor: the step's multiply-adds
(`step_macs`) at the machine's bf16 matmul peak (best `torch.mm` of 2,048^3, same threads),
which on a CPU whose cores cannot keep pace with its memory lies above the roofline.
One JSON line (stdout, and --out if given).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from wideserve.kernels.timing import matmul_peak_gmacs


# Read-only passes over one buffer. torch's `sum` alone read 24.7 GB/s on the 2-vCPU AMX Xeon
# where MKL's matrix-vector product read 30.8 and a plain AVX512 load loop 28-35 (session 20,
# BENCHMARKS.md): a roofline on the slowest reader overstates how close a step is to it.
READERS = {
    "sum": lambda src, ones: src.sum(),
    "dot": lambda src, ones: torch.dot(src, src),
    "mv": lambda src, ones: torch.mv(src.view(-1, ones.numel()), ones),
}


def bandwidth_gbs(threads: int, mib: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """Best-of-`repeats` read and copy bandwidth in GB/s (1e9 bytes/s), on the wall clock.
    The read bandwidth is the fastest of several read-only kernels (READERS, each one's best
    in "read_by_kernel"); at one thread also the median read of that kernel on the thread's
    CPU time ("read_gbs_cpu": time slices given to other processes of a shared machine not
    counted)."""
    torch.set_num_threads(threads)
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)                      # touch every page before timing
    ones = torch.ones(4096, dtype=torch.float32)
    best = {name: 0.0 for name in READERS}
    cpu_reads: dict[str, list[float]] = {name: [] for name in READERS}
    copy = 0.0
    for _ in range(repeats):
        for name, read in READERS.items():
            t, c = time.perf_counter(), time.thread_time()
            read(src, ones)
            cpu_reads[name].append(src.nbytes / max(time.thread_time() - c, 1e-9) / 1e9)
            best[name] = max(best[name], src.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        copy = max(copy, 2 * src.nbytes / (time.perf_counter() - t) / 1e9)
    fastest = max(best, key=best.__getitem__)
    out: dict[str, Any] = {"read_gbs": round(best[fastest], 2), "read_kernel": fastest,
                           "read_by_kernel": {k: round(v, 2) for k, v in best.items()},
                           "copy_gbs": round(copy, 2), "buffer_mib": mib}
    if threads == 1:
        out["read_gbs_cpu"] = round(statistics.median(cpu_reads[fastest]), 2)
    return out


class _DecodeSteps:
    """Records (tokens, requests, seconds, forward seconds, CPU seconds) of every step from
    the engine's StepTimer; CPU seconds: the calling thread's CPU time since the previous
    step finished (the whole step, scheduling included, at one torch thread)."""

    def __init__(self, timer: Any) -> None:
        self.steps: list[tuple[int, int, float, float, float]] = []
        inner = timer.finish
        last = [time.thread_time()]

        def finish(num_tokens: int, num_requests: int) -> None:
            inner(num_tokens, num_requests)
            now = time.thread_time()
            if num_tokens:
                cur = timer.stats.last_seconds
                self.steps.append((num_tokens, num_requests, sum(cur.values()),
                                   cur["forward"], now - last[0]))
            last[0] = now
        timer.finish = finish

    def decode(self, batch: int) -> list[tuple[float, float, float]]:
        return [(s, f, c) for t, r, s, f, c in self.steps if t == r == batch]


def count_active_experts(model: torch.nn.Module,
                         batch: int) -> tuple[list[Any], list[int], int]:
    """Hooks every router (which also sends the forward down the module path). Returns the
    hook handles, the list that collects, per router call on exactly `batch` tokens, the
    number of distinct experts it picked, and the experts per layer."""
    seen: list[int] = []
    handles = []
    num_experts = 0
    for name, m in model.named_modules():
        if name.endswith(".mlp.gate") and hasattr(m, "top_k"):
            num_experts = m.weight.shape[0]

            def hook(_m: Any, args: Any, out: Any) -> None:
                ids = out[0]
                if ids.shape[0] == batch:
                    seen.append(int(torch.unique(ids).numel()))
            handles.append(m.register_forward_hook(hook))
    return handles, seen, num_experts


def coded_experts(model: torch.nn.Module) -> bool:
    """Whether the routed experts run in the lossless 12-bit form (--lossless-experts)."""
    from wideserve.layers.experts import RoutedExperts
    return any(m.lossless for m in model.modules() if isinstance(m, RoutedExperts))


def step_bytes(model: torch.nn.Module, cfg: Any, batch: int, active_experts: float,
               context: float, kv_bytes: int) -> dict[str, float]:
    """Bytes a decode step reads: dense weights, activated experts, embedding rows, KV."""
    from wideserve.layers.experts import RoutedExperts
    expert_params: set[int] = set()
    experts = 0.0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            per_expert = sum(p.nbytes for p in m.parameters()) / m.gate_up_proj.shape[0]
            if m.lossless and m._coded is not None:    # the coded form: what is read
                per_expert = m._coded.coded.nbytes / m.gate_up_proj.shape[0]
            experts += per_expert * active_experts
            expert_params.update(id(p) for p in m.parameters())
    dense = embed = 0.0
    for name, p in model.named_parameters():
        if id(p) in expert_params:
            continue
        if "embed_tokens" in name:
            embed += batch * p.nbytes / p.shape[0]      # one row per token
        else:
            dense += p.nbytes
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * context * layers * kv_heads * head_dim * 2 * kv_bytes
    return {"dense": dense, "experts": experts, "embedding": embed, "kv": kv,
            "total": dense + experts + embed + kv}


def step_macs(model: torch.nn.Module, cfg: Any, batch: int, context: float) -> dict[str, float]:
    """Multiply-adds of a decode step: every token through the dense matrices (not the
    embedding), its top-k experts, and attention's two products over the context. Where the
    cores cannot keep pace with memory (a 2-vCPU Zen 4 reads ~54 GB/s), this, at the matmul
    peak, bounds the step from below more tightly than the bytes do."""
    from wideserve.layers.experts import RoutedExperts
    expert_params: set[int] = set()
    experts = 0.0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            per_expert = sum(p.numel() for p in m.parameters()) / m.gate_up_proj.shape[0]
            experts += batch * cfg.num_experts_per_tok * per_expert
            expert_params.update(id(p) for p in m.parameters())
    dense = sum(batch * p.numel() for name, p in model.named_parameters()
                if id(p) not in expert_params and p.dim() == 2 and "embed_tokens" not in name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * batch * context * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    return {"dense": dense, "experts": experts, "attention": attention,
            "total": dense + experts + attention}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument("--out", default=None, help="append the JSON line to this file too")
    ap.add_argument("--lossless-experts", nargs="?", const="on", default=None,
                    choices=["auto", "on", "off"],
                    help="wideserve's --lossless-experts (default: the engine's, auto); where "
                         "the experts run coded, their bytes per step are the coded ones")
    a = ap.parse_args()
    bw_before = bandwidth_gbs(a.threads, a.bandwidth_mib)
    torch.set_num_threads(a.threads)
    peak = matmul_peak_gmacs(clock="wall")
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    llm = LLM(a.model, dtype="bfloat16", max_model_len=a.input_len + a.output_len + 16,
              max_num_seqs=max(64, a.batch), threads=a.threads,   # else auto: one core fewer
              **({} if a.lossless_experts is None else {"lossless_experts": a.lossless_experts}))
    engine = llm.engine
    rng = random.Random(0)
    ids = [[rng.randrange(3, 8000) for _ in range(a.input_len)] for _ in range(a.batch)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    sp = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    rec = _DecodeSteps(engine.timer)
    llm.generate(prompts, sp, use_tqdm=False)
    decode = rec.decode(a.batch)
    if not decode:
        raise SystemExit(f"no decode step of exactly {a.batch} requests was seen")
    step_s = statistics.median(s for s, _, _ in decode)
    forward_s = statistics.median(f for _, f, _ in decode)
    step_cpu_s = statistics.median(c for _, _, c in decode[1:] or decode)
    # One more, untimed, decode step with hooks on the routers: the experts it activates.
    handles, seen, num_experts = count_active_experts(engine.model, a.batch)
    fresh = [{"prompt_token_ids": [t + 1 for t in p]} for p in ids]
    llm.generate(fresh, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    for h in handles:
        h.remove()
    # Another tenant of the host moves the read bandwidth (32-54 GB/s within an hour on the
    # Zen 4 VM, BENCHMARKS.md): measured before and after the decode, the roofline takes the
    # higher, the stricter of the two (one measurement before only gave a fraction of 1.17).
    bw_after = bandwidth_gbs(a.threads, a.bandwidth_mib)
    bw = dict(max(bw_before, bw_after, key=lambda m: m["read_gbs"]))
    bw["read_gbs_before"], bw["read_gbs_after"] = bw_before["read_gbs"], bw_after["read_gbs"]
    active = statistics.mean(seen) if seen else float(num_experts)
    cfg = engine.model.config
    kv_bytes = torch.finfo(torch.bfloat16).bits // 8
    context = a.input_len + (a.output_len - 1) / 2          # mean over the decode steps
    b = step_bytes(engine.model, cfg, a.batch, active, context, kv_bytes)
    roof_s = b["total"] / (bw["read_gbs"] * 1e9)
    macs = step_macs(engine.model, cfg, a.batch, context)
    floor_s = macs["total"] / (peak * 1e9)
    row = {"bench": "decode_roofline", "model": os.path.basename(a.model.rstrip("/")),
           "batch": a.batch, "threads": a.threads, **bw,
           "lossless_experts": coded_experts(engine.model),
           "decode_steps": len(decode), "step_ms_p50": round(step_s * 1e3, 2),
           "forward_ms_p50": round(forward_s * 1e3, 2),
           "active_experts_per_layer": round(active, 2), "experts_per_layer": num_experts,
           "bytes_per_step_mb": {k: round(v / 1e6, 2) for k, v in b.items()},
           "achieved_gbs": round(b["total"] / step_s / 1e9, 2),
           "roofline_ms": round(roof_s * 1e3, 2),
           "fraction_of_roofline": round(roof_s / step_s, 3),
           "matmul_peak_gmacs": round(peak, 1),
           "macs_per_step_g": {k: round(v / 1e9, 3) for k, v in macs.items()},
           "compute_floor_ms": round(floor_s * 1e3, 2),
           "fraction_of_compute_floor": round(floor_s / step_s, 3),
           **({} if "read_gbs_cpu" not in bw else {
               "step_cpu_ms_p50": round(step_cpu_s * 1e3, 2),
               "roofline_cpu_ms": round(b["total"] / (bw["read_gbs_cpu"] * 1e9) * 1e3, 2),
               "fraction_of_roofline_cpu": round(
                   b["total"] / (bw["read_gbs_cpu"] * 1e9) / step_cpu_s, 3)}),
           "load": os.getloadavg()[0]}
    line = json.dumps(row)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
