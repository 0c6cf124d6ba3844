"""The discrete-event loop: a DEP decode deployment (plus prefill instances under P/D) fed by a
closed-loop workload, advanced one lock-step decode step at a time.

Users: `batch` per decode rank, each sending its next request when the last one finished
(a closed loop at fixed concurrency, the way the recipe measures "N requests per GPU"). The
run starts in steady state: every slot holds a request part-way through its output. Under
P/D a new request is prefilled on the prefill instance that frees first, its KV crosses the
fabric (pd.py) after the decode rank admits it (at most `max_kv_loads_per_step` per step,
each costing host time), and it decodes from the step after the one that admitted it. Colocated, a new prompt is prefilled
inside the next decode step of its rank. Speculation: with k drafts and conditional
per-position acceptance a_1..a_k, a step emits 1 + sum_i prod_{j<=i} a_j tokens per request
in expectation (or, with `draw_acceptance`, a draw per request and step).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from wideserve.sim.eplb import EplbSettings, EplbState, zipf_shares
from wideserve.sim.hardware import Hardware, Profile
from wideserve.sim.model import ModelShape
from wideserve.sim.pd import (PDSettings, admission_s, prefill_s, shared_host_factor,
                              transfer_s)
from wideserve.sim.step import StepInputs, StepModel
from wideserve.sim.workload import SimRequest


@dataclass(slots=True)
class Layout:
    dep: int = 1
    batch: int = 8                          # requests per decode rank
    mtp_k: int = 0
    acceptance: tuple[float, ...] = ()      # conditional acceptance per draft position
    sync_algo: str = "ring"
    overlap_host: bool = True
    skew: float = 0.0                       # Zipf skew of expert routing (0: uniform)
    draft_skew: float = 0.0
    eplb: EplbSettings = field(default_factory=EplbSettings)
    pd: PDSettings = field(default_factory=PDSettings)
    jitter: bool = True
    price_per_gpu_hour: float = 0.0
    served: bool = True                     # behind HTTP servers: the serving path's cost
    # each request's accepted drafts drawn per step from the acceptance profile (a chain of
    # Bernoulli trials) instead of the expected value: a finite batch then lasts as long as
    # its unluckiest request, and its last steps run part-filled
    draw_acceptance: bool = False

    def gpus(self) -> int:
        return self.dep + self.pd.prefill_instances * self.pd.prefill_ranks

    def tokens_per_step(self) -> float:
        acc, run = 1.0, 1.0
        for a in self.acceptance[:self.mtp_k]:
            run *= a
            acc += run
        return acc


@dataclass(slots=True)
class _Req:
    rank: int
    remaining: float
    context: float
    arrival: float
    ready: float = 0.0          # the request reached the decode server (P/D: prefill done)
    xfer: float = 0.0           # its KV transfer's seconds, from the step that admits it
    loaded: float = 0.0         # when that transfer completes
    first: float | None = None
    done_tokens: float = 0.0
    new_tokens: int = 0         # prompt tokens still to prefill (colocated)
    end: float | None = None    # when its last token was emitted


@dataclass(slots=True)
class SimResult:
    layout: Layout
    seconds: float
    steps: int
    step_ms: float
    breakdown_ms: dict[str, float]
    tok_s_per_gpu: float
    p50_user_tok_s: float
    p90_user_tok_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    usd_per_mtok: float | None
    balancedness: dict[str, list[tuple[int, float]]]


class Simulation:
    def __init__(self, model: ModelShape, hw: Hardware, profile: Profile, layout: Layout,
                 workload: Iterator[SimRequest], seed: int = 0, steady: bool = True) -> None:
        self.m, self.hw, self.lay, self.work = model, hw, layout, workload
        self.sm = StepModel(model, hw, profile, seed)
        self.rng = np.random.default_rng(seed)
        self.target = self._eplb(model.moe_layers, model.experts, layout.skew, seed)
        self.draft = (self._eplb(max(1, model.draft_layers), model.draft_experts,
                                 layout.draft_skew, seed + 1)
                      if layout.mtp_k and model.draft_layers else None)
        self.now, self.pending, self.finished = 0.0, [], []
        self.prefill_free = [0.0] * layout.pd.prefill_instances
        self.prefill_batch: list[dict | None] = [None] * layout.pd.prefill_instances
        self.prefill_spans: list[dict] = []     # prefill batches not yet over (shared host)
        # P/D instances sharing one measured host (PDSettings.host_cores): the calibration's
        # always-runnable threads (engine + the resident NIXL agents it was measured beside)
        self.shared_cores = layout.pd.host_cores if hw.kind == "measured" else 0
        self.resident = int(profile.pd.get("resident_threads", 1)) if profile.pd else 1
        # a served request's latency outside the engine steps, once per server leg
        self.request_s = self.sm.request_s() if layout.served else 0.0
        self.running: list[list[_Req]] = [[] for _ in range(layout.dep)]
        self.loading: list[_Req] = []       # admitted, KV in flight (P/D)
        self.exhausted = False
        self.max_loads = 0          # most KV loads one rank admitted in one step
        if steady:
            self._fill_steady()
        else:                       # a benchmark from empty: every slot sends at t = 0
            for r in range(layout.dep):
                for _ in range(layout.batch):
                    self._new_request(r)

    def _eplb(self, layers: int, experts: int, skew: float, seed: int) -> EplbState | None:
        if not experts:
            return None
        shares = (zipf_shares(layers, experts, skew, seed) if skew > 0
                  else np.full((layers, experts), 1.0 / experts))
        return EplbState(shares, self.lay.dep, self.lay.eplb, seed)

    def _fill_steady(self) -> None:
        for r in range(self.lay.dep):
            for _ in range(self.lay.batch):
                q = next(self.work)
                done = float(self.rng.integers(0, q.output_len))
                self.running[r].append(_Req(r, q.output_len - done, q.input_len + done,
                                            arrival=-1.0, first=-1.0))

    def _new_request(self, rank: int) -> None:
        q = next(self.work, None)
        if q is None:               # a finite workload ran out: the slot stays empty
            self.exhausted = True
            return
        req = _Req(rank, float(q.output_len), float(q.input_len), arrival=self.now)
        pd = self.lay.pd
        if pd.prefill_instances:
            self._prefill(req, q.input_len - q.cached, q.cached)
            self.pending.append(req)
        else:
            req.new_tokens = q.input_len - q.cached
            self.running[rank].append(req)

    def _prefill(self, req: _Req, new: int, cached: int) -> None:
        """Queue a prompt on a prefill instance. With `prefill_batch_tokens` a prompt joins the
        instance's batch that has not started yet while it fits the token budget (the engine
        schedules waiting prompts together), and every member finishes with the batch;
        otherwise prompts run one at a time on the instance that frees first (FIFO). The first
        token reaches the user from the decode step that admits the KV (a router streams the
        decode leg), set in _advance."""
        pd = self.lay.pd
        table = (self.sm.p.ops.get("prefill") or self.sm.p.pd.get("prefill")
                 if self.hw.kind == "measured" else None)

        def cost(members: list[tuple[_Req, int, int]]) -> float:
            # a served prefill instance's step pays the serving path like a decode step
            serve = self.sm.serving_s(len(members)) if self.lay.served else 0.0
            if table:           # the measured table at the batch's total tokens
                return serve + prefill_s(self.m, self.hw, sum(n for _, n, _ in members), 0,
                                         pd.prefill_ranks, table)
            return serve + sum(prefill_s(self.m, self.hw, n, c, pd.prefill_ranks)
                               for _, n, c in members)
        budget = pd.prefill_batch_tokens
        for i, b in enumerate(self.prefill_batch):
            if budget and b and b["start"] >= self.now and b["tokens"] + new <= budget:
                b["members"].append((req, new, cached))
                b["tokens"] += new
                break
        else:
            i = int(np.argmin(self.prefill_free))
            b = {"start": max(self.now, self.prefill_free[i]), "tokens": new,
                 "members": [(req, new, cached)]}
            self.prefill_batch[i] = b
        # on a shared host the prefill runs beside the decode ranks that go on computing
        # (requests still to decode; a request that just finished is not one)
        busy = sum(1 for rs in self.running if any(x.remaining > 1e-9 for x in rs))
        end = b["start"] + cost(b["members"]) * shared_host_factor(self.shared_cores,
                                                                    self.resident, busy)
        if "end" not in b:
            self.prefill_spans.append(b)
        b["end"] = end
        self.prefill_free[i] = end
        # served: the router has the prefill leg's answer one request latency after the
        # prefill step, and the decode leg reaches the decode engine one more later (both
        # legs charged before the KV load is admitted: docs/simulator.md)
        for r, n, c in b["members"]:
            r.ready = end + 2 * self.request_s
            r.xfer = transfer_s(self.m, self.hw, pd, n + c)

    def _admit(self) -> list[float]:
        """The decode engine's KV loads (engine/engine_core.py, disagg/connector.py): at a
        step's start, loads finished during earlier steps reach the scheduler (finish_step)
        and their requests join the batch; then the scheduler admits waiting requests (at most
        `max_kv_loads_per_step` per rank), allocating their blocks, and the step starts their
        transfers (start_step), which run while the step computes. A request admitted at step
        N therefore decodes its first token at step N + 1 at the earliest. Returns each rank's
        admission host seconds (the measured per-load cost at each request's context)."""
        keep_loading = []
        for req in self.loading:
            if req.loaded <= self.now:
                self.running[req.rank].append(req)
            else:
                keep_loading.append(req)
        self.loading = keep_loading
        cap = self.lay.pd.max_kv_loads_per_step
        loads, cost = [0] * self.lay.dep, [0.0] * self.lay.dep
        keep = []
        for req in sorted(self.pending, key=lambda x: x.ready):
            r = req.rank
            if req.ready <= self.now and (cap is None or loads[r] < cap):
                loads[r] += 1
                cost[r] += admission_s(self.sm.p, self.hw, req.context)
                req.loaded = self.now + req.xfer
                self.loading.append(req)
            else:
                keep.append(req)
        self.pending = keep
        self.max_loads = max(self.max_loads, *loads)
        return cost

    def step(self, index: int) -> dict[str, float]:
        lay, m = self.lay, self.m
        loads = self._admit()
        reqs = [len(rs) for rs in self.running]
        prefill = [sum(x.new_tokens for x in rs) for rs in self.running]
        ctx = [float(np.mean([x.context for x in rs])) if rs else 0.0 for rs in self.running]
        q = 1 + lay.mtp_k
        total_rows = (sum(reqs) * q + sum(prefill)) * m.top_k
        host_len = self.sm.host_s(max(reqs), max(reqs) * q)
        jit = (list(self.sm.noise.draw(host_len, (lay.dep,), self.rng)) if lay.jitter
               else [0.0] * lay.dep)
        jit = [j + loads[r] for r, j in enumerate(jit)]
        inputs = StepInputs(
            lay.dep, [r + (p // q if p else 0) for r, p in zip(reqs, prefill)], ctx, lay.mtp_k,
            self.target.rank_rows(total_rows) if self.target else None,
            self._draft_rows(sum(reqs)), lay.sync_algo, lay.overlap_host, jit, lay.jitter,
            lay.served)
        st = self.sm.step(inputs)
        stretch = self._shared_stretch(st.step_s)
        step_s = st.step_s * stretch
        self.now += step_s
        self._advance(lay.tokens_per_step())
        if self.target:
            self.target.after_step(index, total_rows)
        if self.draft:
            self.draft.after_step(index, sum(reqs) * q * m.draft_top_k)
        return st.parts | {"step": step_s, "shared_host": step_s - st.step_s}

    def _shared_stretch(self, step_s: float) -> float:
        """On a shared host (PDSettings.host_cores), the decode step's compute shares the
        cores with the prefill batches running during it: the step's time-weighted mean of
        shared_host_factor over the prefill instances busy at each moment (computed on the
        unstretched step, a first-order estimate). 1 otherwise."""
        self.prefill_spans = [b for b in self.prefill_spans if b["end"] > self.now]
        if not self.shared_cores or not self.prefill_spans or step_s <= 0:
            return 1.0
        t0, t1 = self.now, self.now + step_s
        cuts = sorted({t0, t1, *(min(max(x, t0), t1) for b in self.prefill_spans
                                 for x in (b["start"], b["end"]))})
        acc = 0.0
        for a, z in zip(cuts, cuts[1:]):
            mid = (a + z) / 2
            k = sum(1 for b in self.prefill_spans if b["start"] <= mid < b["end"])
            acc += (z - a) * shared_host_factor(self.shared_cores, self.resident, k)
        return acc / step_s

    def _draft_rows(self, reqs: int) -> np.ndarray | None:
        if not self.draft:
            return None
        per_pass = reqs * ((self.lay.mtp_k + 1) if self.m.draft_parallel else 1)
        return self.draft.rank_rows(per_pass * self.m.draft_top_k)

    def _advance(self, tokens: float) -> None:
        for r in range(len(self.running)):
            rs = list(self.running[r])
            keep = []
            for x in rs:
                if x.new_tokens:                       # colocated prefill ran this step
                    x.new_tokens = 0
                    x.first = self.now
                    emitted = 1.0
                else:
                    if x.first is None:                # first decode step after a KV load
                        x.first = self.now
                    emitted = min(self._draw_tokens() if self.lay.draw_acceptance else tokens,
                                  x.remaining)
                x.remaining -= emitted
                x.done_tokens += emitted
                x.context += emitted
                if x.remaining <= 1e-9:
                    x.end = self.now
                    self.finished.append(x)
                    self._new_request(r)
                else:
                    keep.append(x)
            self.running[r] = keep + [y for y in self.running[r][len(rs):]]

    def _draw_tokens(self) -> float:
        """Tokens one request emits in one step: 1 + the drafts accepted in a row, each
        position accepted with its conditional probability."""
        n = 1
        for a in self.lay.acceptance[:self.lay.mtp_k]:
            if self.rng.random() >= a:
                break
            n += 1
        return float(n)

    def run_to_end(self, max_steps: int = 1_000_000) -> SimResult:
        """A finite workload from empty until every request finished (a benchmark run);
        an idle decode rank waits for the next KV to arrive."""
        parts: dict[str, float] = {}
        steps = 0
        while steps < max_steps and (any(self.running) or self.pending or self.loading):
            if not any(self.running):       # idle: on to the next arrival or finished load
                self.now = max(self.now, min([x.ready for x in self.pending]
                                             + [x.loaded for x in self.loading]))
            for k, v in self.step(steps).items():
                parts[k] = parts.get(k, 0.0) + v
            steps += 1
        return self._result(max(steps, 1), parts)

    def run(self, steps: int) -> SimResult:
        if steps < 1:
            raise ValueError("--steps must be >= 1")
        parts: dict[str, float] = {}
        for i in range(steps):
            for k, v in self.step(i).items():
                parts[k] = parts.get(k, 0.0) + v
        return self._result(steps, parts)

    def _result(self, steps: int, parts: dict[str, float]) -> SimResult:
        lay = self.lay
        live = [x for rs in self.running for x in rs]
        tokens = sum(x.done_tokens for x in self.finished + live)
        def span(x: _Req) -> float:
            return (x.end if x.end is not None else self.now) - max(x.first, 0.0)
        rates = [x.done_tokens / span(x) for x in self.finished + live
                 if x.first is not None and span(x) > 0 and x.done_tokens > 1]
        # colocated and served: the one server's request latency lies outside the steps
        leg = 0.0 if lay.pd.prefill_instances else self.request_s
        ttft = [x.first - x.arrival + leg for x in self.finished + live
                if x.arrival >= 0 and x.first is not None]
        tps_gpu = tokens / self.now / lay.gpus()
        usd = (lay.price_per_gpu_hour / 3600 / tps_gpu * 1e6) if lay.price_per_gpu_hour else None
        bal = {"target": self.target.history if self.target else [],
               "draft": self.draft.history if self.draft else []}
        return SimResult(
            lay, self.now, steps, 1e3 * parts["step"] / steps,
            {k: 1e3 * v / steps for k, v in parts.items() if k != "step"}, tps_gpu,
            float(np.percentile(rates, 50)) if rates else 0.0,
            float(np.percentile(rates, 10)) if rates else 0.0,
            float(np.percentile(ttft, 50)) if ttft else None,
            float(np.percentile(ttft, 90)) if ttft else None, usd, bal)
