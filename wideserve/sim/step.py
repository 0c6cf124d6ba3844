"""One lock-step decode step of a DEP deployment: each rank's own time, then the barrier.

Per rank r with R_r running requests, q = 1 + k query tokens each (k drafts verified), T_r = q R_r:
  host_r  = (base + per_request R_r + per_token T_r) / host_speed + jitter_r
            + serving(R_r) behind a server (the calibrated serving path)
  gpu_r   = dense + attention + sum over MoE layers (experts_r + all-to-all) + drafts
  step    = max(max_r gpu_r, max_r host_r + sync)       host overlapped with the device
  step    = max_r host_r + sync + max_r gpu_r            host and device in series
The DP sync is a collective, so every rank leaves it when the slowest host arrives; the
all-to-all inside each MoE layer makes the forward lock-step too, so the slowest rank's
device time sets the step. Device times are rooflines on a described GPU or measured tables
on a calibrated machine (costs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wideserve.sim.costs import allreduce_s, alltoall_s, interp, roofline_s
from wideserve.sim.hardware import Hardware, Profile
from wideserve.sim.model import FORMAT_BYTES, ModelShape
from wideserve.sim.noise import HostNoise

DISPATCH_BYTES = 1 + 1 / 32     # FP8 activations with a UE8M0 scale per 32 (DeepEP-style)
COMBINE_BYTES = 2               # bf16 expert outputs back
SYNC_BYTES = 16                 # the step's shape row: a few int32s
HOST_PARTS = ("host", "serving")    # a rank's host side; every other part is device work


@dataclass(slots=True)
class StepInputs:
    ranks: int
    requests: list[int]                 # running requests per rank
    context: list[float]                # mean context length per rank
    drafts: int = 0                     # k
    rank_rows: np.ndarray | None = None          # [L, R] routed rows per rank (target)
    draft_rank_rows: np.ndarray | None = None    # [Ld, R] (draft)
    sync_algo: str = "ring"
    overlap_host: bool = True
    jitter: list[float] = field(default_factory=list)   # per-rank host jitter (s)
    noise: bool = False                 # draw lock-step waits from the measured host noise
    served: bool = False                # behind an HTTP server: charge the serving path


@dataclass(slots=True)
class StepTime:
    step_s: float
    parts: dict[str, float]             # the slowest rank's breakdown (s)
    per_rank_s: list[float]             # each rank's own time (host + device, no barrier)


class StepModel:
    """Step times of one model on one hardware with one calibration profile."""

    def __init__(self, model: ModelShape, hw: Hardware, profile: Profile,
                 seed: int = 0) -> None:
        self.m, self.hw, self.p = model, hw, profile
        self.measured = hw.kind == "measured"
        self.noise = HostNoise(profile.host.get("jitter_s") or [])
        self.rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------ host side
    def host_s(self, requests: int, tokens: int) -> float:
        h = self.p.host
        return (h["base_s"] + h["per_request_s"] * requests + h["per_token_s"] * tokens) \
            / self.hw.host_speed

    def serving_s(self, requests: int) -> float:
        """Host seconds per step the serving path adds (engine-proc loop, IPC, the API
        server's detokenize and streaming): the calibrated `loop_s` at this batch
        (calibrate_pd.serving_table), the served period less the served engine's own step,
        both from the same runs. The table's `s` (period less the in-process step, measured
        minutes apart) is kept as a diagnostic, not charged: on a shared machine the load
        drifts between those minutes by more than the serving path costs (docs/simulator.md).
        0 when the profile has no serving table."""
        t = self.p.host.get("serving")
        if not t or requests <= 0:
            return 0.0
        return interp(t["batch"], t["loop_s"], requests) / self.hw.host_speed

    def request_s(self) -> float:
        """A served request's latency outside the engine's steps, per server it passes
        (HTTP in, hand-over to the engine process, the token out): calibrate_pd.
        measure_request, scaled by the host speed; 0 when the profile has none."""
        t = self.p.host.get("serving") or {}
        return float(t.get("request_s", 0.0)) / self.hw.host_speed

    def sync_s(self, ranks: int, algo: str) -> float:
        c = self.p.collectives
        alpha = c.get("host_alpha_s", c["allreduce_alpha_s"])
        return allreduce_s(ranks, SYNC_BYTES, alpha, c.get("host_bytes_per_s", 1e9), algo)

    # ------------------------------------------------------------------ device side
    def dense_s(self, tokens: int) -> float:
        if self.measured:
            f = self.p.ops["dense_forward"]
            return interp(f["tokens"], f["s"], tokens)
        m = self.m
        return roofline_s(self.hw, 2 * m.dense_params * tokens, m.dense_bytes, m.weight_format,
                          kernels=8 * m.layers)

    def attention_s(self, requests: int, ctx: float, q: int) -> float:
        """Attention + indexer of all layers: records read once per request, FLOPs per query."""
        if self.measured or requests == 0:
            return 0.0          # measured: inside dense_forward (short contexts only)
        m, rec = self.m, self.m.record_bytes
        per_layer_kv = m.kv_bytes_per_token / max(1, m.layers)
        nbytes = flops = 0.0
        for a in m.attn:
            entries, scanned = a.entries(int(ctx)), a.scanned(int(ctx))
            if a.ratio == 1 and a.topk is None and not a.window:      # plain full attention
                nbytes += ctx * per_layer_kv
                flops += 4 * m.heads * m.head_dim * ctx * q
                continue
            nbytes += (a.window * rec.get("window", 0) + q * entries * rec.get("compressed", 0)
                       + scanned * rec.get("indexer", 0))
            flops += 4 * m.heads * m.head_dim * (a.window + entries) * q \
                + 2 * m.index_heads * m.index_dim * scanned * q
        return roofline_s(self.hw, flops * requests, nbytes * requests, "bf16",
                          kernels=3 * m.layers)

    def experts_s(self, rows: np.ndarray, experts_per_rank: float, params_each: float,
                  fmt: str) -> np.ndarray:
        """[L, R] rows per rank -> [R] seconds in the experts over all layers. Experts that
        receive a row: E_r (1 - (1 - 1/E_r)^rows) in expectation (rows spread evenly)."""
        if rows.size == 0:
            return np.zeros(rows.shape[1] if rows.ndim == 2 else 0)
        e_r = max(experts_per_rank, 1.0)
        active = e_r * (1 - (1 - 1 / e_r) ** np.maximum(rows, 0))
        per = np.where(active > 0, rows / np.maximum(active, 1e-12), 0.0)
        if self.measured:
            e = self.p.ops["expert"]
            t = active * np.vectorize(lambda x: interp(e["rows"], e["s"], x) if x > 0 else 0.0,
                                      otypes=[float])(per)
            return t.sum(axis=0)
        nbytes = active * params_each * FORMAT_BYTES[fmt]
        flops = 2 * params_each * rows
        t = np.maximum(flops / self.hw.peak(fmt), nbytes / self.hw.mem_bytes_per_s) \
            + 2 * self.hw.kernel_gap_s
        return t.sum(axis=0)

    def a2a_s(self, ranks: int, rows_sent: float, layers: int) -> float:
        """Counts, dispatch and combine per MoE layer."""
        if ranks <= 1 or layers == 0:
            return 0.0
        if self.measured:
            c = self.p.collectives["alltoall"]
            beta, alpha = c["bytes_per_s"], c["alpha_s"]
        else:
            beta, alpha = self.hw.link(ranks)
        d, conc = self.m.hidden, not self.measured
        one = (alltoall_s(ranks, 8 * ranks, alpha, beta, conc)
               + alltoall_s(ranks, rows_sent * d * DISPATCH_BYTES, alpha, beta, conc)
               + alltoall_s(ranks, rows_sent * d * COMBINE_BYTES, alpha, beta, conc))
        return layers * one

    def weight_bytes_per_rank(self, ranks: int, total_rows: float) -> float:
        """Weight bytes one rank reads per step: its dense copy plus the experts that receive
        a row, with `total_rows` routed rows spread evenly over all experts."""
        m = self.m
        e_r = max(m.experts / ranks, 1.0)
        rows = total_rows / ranks
        active = e_r * (1 - (1 - 1 / e_r) ** rows)
        return m.dense_bytes + m.moe_layers * active * m.expert_params_each() \
            * FORMAT_BYTES[m.expert_format]

    # ------------------------------------------------------------------ one step
    def step(self, s: StepInputs) -> StepTime:
        m, q = self.m, 1 + s.drafts
        n = s.ranks
        tokens = [r * q for r in s.requests]
        rows = s.rank_rows if s.rank_rows is not None else uniform_rows(
            m.moe_layers, n, sum(tokens) * m.top_k)
        expert = self.experts_s(rows, m.experts / n, m.expert_params_each(), m.expert_format)
        draft = self._drafts_s(s, n)
        ep = self._ep_table(n)
        if ep is not None:
            return self._measured_ep_step(s, tokens, rows, expert, draft, ep)
        a2a = self.a2a_s(n, max(tokens) * m.top_k, m.moe_layers)
        parts_r = []
        wait = self._lockstep_wait(n, tokens, expert, s)
        # With a measured meeting table the host phase is another stretch between two
        # meetings (the DP sync wakes it): its preemptions are in the table's waits, not
        # drawn again (the engine's DEP2 host phase measured 0.25 ms where draws gave 4-10).
        jitter = [] if self._meeting_table(n, s) else s.jitter
        for r in range(n):
            parts_r.append({
                "host": self.host_s(s.requests[r], tokens[r]) + (jitter[r] if jitter else 0),
                "dense": self.dense_s(tokens[r]),
                "attention": self.attention_s(s.requests[r], s.context[r], q),
                "moe": float(expert[r]), "all_to_all": a2a, "lockstep_wait": wait,
                "draft": float(draft[r]),
                "serving": self.serving_s(s.requests[r]) if s.served else 0.0})
        return self._barrier(parts_r, self.sync_s(n, s.sync_algo), s.overlap_host)

    def _ep_table(self, n: int) -> dict | None:
        """The calibrated EP MoE layer at n ranks (calibrate_ep.py; a measured machine)."""
        if not self.measured or n <= 1 or self.m.moe_layers == 0:
            return None
        return (self.p.collectives.get("ep_layer") or {}).get(str(n))

    def _measured_ep_step(self, s: StepInputs, tokens: list[int], rows: np.ndarray,
                          expert: np.ndarray, draft: np.ndarray, ep: dict) -> StepTime:
        """A DEP step on a calibrated machine with the EP layer measured at n ranks
        (calibrate_ep.py): each MoE layer costs what the engine's dispatcher measured at this
        step's tokens per rank (the padded path's size: the busiest rank's), split into the
        grouped MLP (`moe`), the exchanges with their waits for the peer (`all_to_all`) and
        the dispatcher's own work (`ep_dispatch`); plus the step header and close once per
        step (`ep_step`). The dense part is the one-rank measurement at the rank's own
        tokens, in CPU seconds. Skewed routing (EPLB) scales each rank's grouped MLP by its expert time over
        the uniform routing's (experts_s)."""
        n, m, q = s.ranks, self.m, 1 + s.drafts
        T = max(tokens)
        at = {k: interp(ep["tokens"], ep[k], T) for k in ("layer_s", "a2a_s", "expert_s",
                                                          "step_s")}
        L = m.moe_layers
        uniform = self.experts_s(uniform_rows(L, n, float(rows.sum(axis=1).mean()) if rows.size
                                              else 0.0), m.experts / n, m.expert_params_each(),
                                 m.expert_format)
        scale = np.where(uniform > 0, expert / np.maximum(uniform, 1e-12), 1.0)
        rest = max(at["layer_s"] - at["a2a_s"] - at["expert_s"], 0.0)
        # The dense forward in CPU seconds (its measured wall time x the CPU share the
        # one-rank calibration got): a DEP rank blocks in every exchange, and a woken
        # rank gets a core at once, so its compute runs at the speed of its CPU time even
        # on a loaded machine (docs/simulator.md); on a quiet one the share is 1.
        share = self.p.host.get("cpu_share", 1.0)
        parts_r = [{
            "host": self.host_s(s.requests[r], tokens[r]),
            "dense": self.dense_s(tokens[r]) * share,
            "attention": self.attention_s(s.requests[r], s.context[r], q),
            "moe": L * at["expert_s"] * float(scale[r]), "all_to_all": L * at["a2a_s"],
            "ep_dispatch": L * rest, "ep_step": at["step_s"], "lockstep_wait": 0.0,
            "draft": float(draft[r]),
            "serving": self.serving_s(s.requests[r]) if s.served else 0.0} for r in range(n)]
        return self._barrier(parts_r, self.sync_s(n, s.sync_algo), s.overlap_host)

    def _lockstep_wait(self, n: int, tokens: list[int], expert: np.ndarray,
                       s: StepInputs) -> float:
        """On a measured machine the forward runs on the host: each exchange waits for the
        slowest peer's preemptions and for the OS to wake the blocked rank. The step makes
        3 exchanges per MoE layer (counts, rows, outputs: layers/ep_dispatch.py) plus one per
        step (the padded path's step header or the exact path's closing round). With a
        measured meeting table at n ranks (calibrate.py, _lockstep_meetings) each exchange
        costs the table's mean at this step's host work between exchanges (in CPU seconds:
        the measured forward's wall time x the CPU share the engine got), less the latency
        a2a_s already books; without one, waits are drawn from the host noise (noise.py). On
        a GPU the forward is device work (a captured graph): no host noise inside it."""
        if not self.measured or n <= 1 or not s.noise:
            return 0.0
        layers = self.m.moe_layers + (self.m.draft_layers if s.drafts else 0)
        points = 3 * layers + 1
        seg = (self.dense_s(max(tokens)) + float(expert.max())) / points
        table = self._meeting_table(n, s)
        if table:
            # the table's axis is the CPU seconds of work between exchanges; the measured
            # forward is wall time, of which the engine got `cpu_share` on the CPU
            seg *= self.p.host.get("cpu_share", 1.0)
            meet = interp(table["segment_cpu_s"], table["s"], seg)
            alpha = self.p.collectives["alltoall"]["alpha_s"] * (n - 1)
            return points * meet - 3 * layers * min(alpha, meet)
        return self.noise.lockstep_wait(points - 1, seg, n, self.rng)

    def _meeting_table(self, n: int, s: StepInputs) -> dict | None:
        """The calibrated lock-step meeting table at n ranks (a measured machine only)."""
        if not self.measured or n <= 1 or not s.noise:
            return None
        return (self.p.collectives.get("meeting") or {}).get(str(n))

    def _drafts_s(self, s: StepInputs, n: int) -> np.ndarray:
        m, k = self.m, s.drafts
        if k == 0 or m.draft_layers == 0:
            return np.zeros(n)
        passes = 1 if m.draft_parallel else k          # DSpark: one pass of k+1 tokens
        per_pass = [r * ((k + 1) if m.draft_parallel else 1) for r in s.requests]
        rows = s.draft_rank_rows if s.draft_rank_rows is not None else uniform_rows(
            max(1, m.draft_layers), n, sum(per_pass) * m.draft_top_k)
        each = m.draft_expert_params / max(1, m.draft_layers * m.draft_experts)
        ex = self.experts_s(rows, m.draft_experts / n, each, m.expert_format)
        dense = np.array([self._draft_dense_s(t) for t in per_pass])
        a2a = self.a2a_s(n, max(per_pass) * m.draft_top_k, m.draft_layers)
        return passes * (dense + ex + a2a)

    def _draft_dense_s(self, tokens: int) -> float:
        if self.measured:
            f = self.p.ops.get("draft_forward") or self.p.ops["dense_forward"]
            return interp(f["tokens"], f["s"], tokens)
        m = self.m
        return roofline_s(self.hw, 2 * m.draft_dense_params * tokens,
                          m.draft_dense_params * FORMAT_BYTES[m.weight_format],
                          m.weight_format, kernels=8 * m.draft_layers)

    @staticmethod
    def _barrier(parts_r: list[dict[str, float]], sync: float, overlap: bool) -> StepTime:
        gpu = [sum(v for k, v in p.items() if k not in HOST_PARTS) for p in parts_r]
        host = [sum(p.get(k, 0.0) for k in HOST_PARTS) for p in parts_r]
        if overlap:
            own = [max(g, h + sync) for g, h in zip(gpu, host)]
            step = max(max(gpu), max(host) + sync)
        else:
            own = [h + sync + g for g, h in zip(gpu, host)]
            step = max(host) + sync + max(gpu)
        slow = parts_r[int(np.argmax(gpu))]
        parts = {**slow, "host": max(p["host"] for p in parts_r),
                 "serving": max(p.get("serving", 0.0) for p in parts_r), "dp_sync": sync,
                 "barrier_wait_mean": step - float(np.mean(own))}
        return StepTime(step, parts, own)


def uniform_rows(layers: int, ranks: int, total_rows: float) -> np.ndarray:
    """Routed rows per rank when every expert is equally likely: [L, R]."""
    return np.full((max(layers, 0), ranks), total_rows / ranks)

