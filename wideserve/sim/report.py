"""Text output of a simulation: results, per-step breakdown, and every parameter used (with the
source of each hardware number), so a reader can check what the answer rests on."""
from __future__ import annotations

from typing import Any

from wideserve.sim.hardware import Hardware, Profile
from wideserve.sim.model import FORMAT_BYTES, ModelShape
from wideserve.sim.simulator import SimResult
from wideserve.sim.step import StepModel


def parameters(m: ModelShape, hw: Hardware, prof: Profile) -> dict[str, Any]:
    host = {k: v for k, v in prof.host.items() if k != "jitter_s"}
    jit = sorted(prof.host.get("jitter_s") or [0.0])
    host["jitter_s (p50, p99 of samples)"] = [jit[len(jit) // 2], jit[int(0.99 * (len(jit) - 1))]]
    return {
        "model": {"name": m.name, "layers": m.layers, "experts": m.experts, "top_k": m.top_k,
                  "dense_params": m.dense_params, "expert_params": m.expert_params,
                  "draft_dense_params": m.draft_dense_params,
                  "draft_expert_params": m.draft_expert_params,
                  "weight_format": f"{m.weight_format} ({FORMAT_BYTES[m.weight_format]:.4f} B)",
                  "expert_format": f"{m.expert_format} ({FORMAT_BYTES[m.expert_format]:.4f} B)",
                  "kv_bytes_per_token (KV spec)": m.kv_bytes_per_token,
                  "kv_bounded_bytes_per_request (KV spec)": m.kv_bounded_bytes,
                  "kv_record_bytes": m.record_bytes},
        "hardware": {k: getattr(hw, k) for k in Hardware.__slots__ if k != "sources"},
        "hardware_sources": hw.sources,
        "profile": {"machine": prof.machine, "host": host,
                    "collectives": {k: v for k, v in prof.collectives.items()
                                    if k != "alltoall"} | {"alltoall": {
                                        k: v for k, v in prof.collectives["alltoall"].items()
                                        if k in ("alpha_s", "bytes_per_s")}}},
    }


def describe(r: SimResult, m: ModelShape, hw: Hardware, prof: Profile) -> list[str]:
    lay = r.layout
    lines = [f"simulated {r.steps} steps ({r.seconds:.2f} s) of {m.name} on {hw.name}: "
             f"DEP{lay.dep}, {lay.batch} requests/rank, MTP k={lay.mtp_k}, sync {lay.sync_algo}, "
             f"EPLB {'on' if lay.eplb.enabled else 'off'}, "
             f"{lay.pd.prefill_instances} prefill instance(s) x {lay.pd.prefill_ranks} GPUs",
             f"  step: {r.step_ms:.3f} ms; per step (slowest rank, ms): " + ", ".join(
                 f"{k} {v:.3f}" for k, v in r.breakdown_ms.items()),
             f"  output tokens/s per GPU: {r.tok_s_per_gpu:,.0f}",
             f"  tokens/s per user: P50 {r.p50_user_tok_s:.1f}, P90 {r.p90_user_tok_s:.1f}"]
    # What bounds a decode step on bandwidth: the dense copy plus the experts that receive a
    # row, with every rank's rows of a full step (drafts included) spread evenly.
    rows = lay.dep * lay.batch * (1 + lay.mtp_k) * m.top_k
    gb = StepModel(m, hw, prof).weight_bytes_per_rank(lay.dep, rows) / 1e9
    lines.append(f"  weights read per rank per step: {gb:,.2f} GB "
                 f"({gb / max(r.step_ms, 1e-9) * 1e3:,.0f} GB/s at the simulated step)")
    if r.ttft_p50_s is not None:
        lines.append(f"  TTFT: P50 {r.ttft_p50_s:.3f} s, P90 {r.ttft_p90_s:.3f} s")
    if r.usd_per_mtok is not None:
        lines.append(f"  cost: ${r.usd_per_mtok:.4f} per million output tokens at "
                     f"${lay.price_per_gpu_hour}/GPU-hour")
    for name, hist in r.balancedness.items():
        if hist:
            lines.append(f"  EPLB {name} balancedness: " + " -> ".join(
                f"{b:.2f} (step {s})" for s, b in hist[:4]))
    lines.append("  parameters:")
    for group, vals in parameters(m, hw, prof).items():
        if group == "hardware_sources":
            continue
        lines.append(f"    {group}: " + ", ".join(f"{k}={v}" for k, v in vals.items()))
    lines.append("  hardware sources:")
    lines += [f"    {k}: {v}" for k, v in hw.sources.items()]
    return lines
