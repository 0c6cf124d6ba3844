"""Synthetic AgentX-like agentic-coding sessions, written as Weka-trace JSON
(docs/benchmarking.md, "The synthetic generator"; AIPerf replays them with `--custom-dataset-type weka_trace`).

A session (trace) is a tools+system prefix, then main turns whose context grows by the previous
output plus new user/tool content (heavy-tailed), with compaction when the context would pass
the cap, think times between turns, and subagent groups (concurrent children, each with a prefix
of its own: "spawn" semantics) that the next main turn joins. Every token count is multiplied by
`scale`, so the same shape fits a CPU and a toy model.

Block ids (`hash_ids`) are local to a session and name 64-token blocks of the prompt: the same id
at the same position means the same prefix. Full blocks of a context keep their ids as it grows;
its partial tail block gets a fresh id whenever its content changes.

All draws come from one numpy Generator seeded per session (seed, index), so a session does not
depend on how many others are generated.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

MAIN_MODEL, SUB_MODEL = "agentx-synthetic-main", "agentx-synthetic-subagent"


@dataclass(slots=True)
class AgenticParams:
    """Defaults reproduce AgentX v1.0 (1M context); `preset("256k")` the 256k variant.
    Token counts are before `scale`; lognormals are (median, sigma)."""

    scale: float = 1.0
    block_size: int = 64
    context_cap: int = 1_000_000            # compaction threshold (tokens)
    prefix: tuple[float, float] = (15_000, 0.10)        # tools + system
    history: tuple[float, float] = (12_000, 2.0)         # context a session resumes with
    turns: tuple[float, float] = (45, 0.9)
    min_turns: int = 20
    max_turns: int = 330
    new_content: tuple[float, float] = (200, 2.2)       # user/tool tokens added per turn
    max_new_content: int = 200_000
    osl: tuple[float, float] = (444, 1.1)
    max_osl: int = 32_000
    min_osl: int = 1
    summary: tuple[int, int] = (10_000, 30_000)         # compaction summary, uniform
    think_s: tuple[float, float] = (10.0, 2.2)
    max_think_s: float = 4 * 3600.0
    subagent_session_frac: float = 0.44
    groups: tuple[float, float] = (4, 1.3)              # groups per participating session
    children_p: float = 0.8                             # children ~ geometric(p), <= 10
    max_children: int = 10
    child_prefix: tuple[float, float] = (13_500, 0.10)
    child_task: tuple[float, float] = (5_000, 0.8)
    child_requests: tuple[float, float] = (11, 0.45)
    child_new_content: tuple[float, float] = (2_500, 1.0)
    child_osl: tuple[float, float] = (235, 1.0)
    child_think_s: tuple[float, float] = (4.0, 1.0)
    api_s_per_output_token: float = 1 / 80             # informational api_time model
    api_base_s: float = 1.5

    @staticmethod
    def preset(name: str, **overrides: Any) -> "AgenticParams":
        if name in ("full", "1m"):
            base = AgenticParams()
        elif name == "256k":
            base = AgenticParams(context_cap=256_000, history=(7_000, 1.6), turns=(40, 0.9),
                                 max_new_content=60_000, osl=(376, 1.1),
                                 summary=(8_000, 20_000))
        else:
            raise ValueError(f"unknown agentic preset {name!r}; use 'full' or '256k'")
        return replace(base, **overrides)


class _BlockIds:
    """Session-local block-id allocator."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


class _Context:
    """A growing prompt: its length and the ids of its blocks (tail block refreshed on change)."""

    def __init__(self, ids: _BlockIds, block_size: int, length: int) -> None:
        self.ids, self.bs = ids, block_size
        self.length = 0
        self.blocks: list[int] = []
        self.grow(length)

    def grow(self, n: int) -> None:
        keep = self.length // self.bs              # full blocks are unchanged by appending
        self.length += n
        del self.blocks[keep:]
        self.blocks += self.ids.take(math.ceil(self.length / self.bs) - keep)

    def reset(self, keep_tokens: int, add: int) -> None:
        """Compaction: keep the first keep_tokens (the prefix), then add a fresh summary."""
        self.blocks = self.blocks[:keep_tokens // self.bs]
        self.length = len(self.blocks) * self.bs
        self.grow(keep_tokens - self.length + add)


class _Draw:
    """Scaled lognormal draws; normals come from a buffer (a scalar numpy call costs more
    than the rest of the generator)."""

    def __init__(self, rng: np.random.Generator, scale: float) -> None:
        self.rng, self.scale = rng, scale
        self._normals: list[float] = []

    def normal(self) -> float:
        if not self._normals:
            self._normals = self.rng.standard_normal(1024).tolist()
        return self._normals.pop()

    def lognormal(self, ms: tuple[float, float]) -> float:
        return ms[0] * math.exp(ms[1] * self.normal())

    def tokens(self, ms: tuple[float, float], lo: int = 1, hi: float = math.inf) -> int:
        """A scaled lognormal token count, clipped to [lo, hi * scale]."""
        n = round(min(self.lognormal(ms), hi) * self.scale)
        return int(max(n, lo))


def _request(t: float, model: str, ctx: _Context, out: int, think: float, api: float
             ) -> dict[str, Any]:
    return {"t": round(t, 3), "type": "n", "model": model, "in": ctx.length, "out": out,
            "hash_ids": list(ctx.blocks), "api_time": round(api, 3),
            "think_time": round(think, 3), "input_types": ["text"], "output_types": ["text"],
            "stop": ""}


def _api_time(p: AgenticParams, d: _Draw, out: int) -> float:
    return (p.api_base_s + out / max(p.scale, 1e-9) * p.api_s_per_output_token) * \
        math.exp(0.3 * d.normal())


def _child(p: AgenticParams, d: _Draw, ids: _BlockIds, t0: float, agent_id: str
           ) -> dict[str, Any]:
    prefix = d.tokens(p.child_prefix)
    ctx = _Context(ids, p.block_size, prefix + d.tokens(p.child_task))
    n = int(min(max(round(d.lognormal(p.child_requests)), 1), 40))
    t, reqs = t0, []  # type: float, list[dict[str, Any]]
    for k in range(n):
        think = 0.0 if k == 0 else min(d.lognormal(p.child_think_s), p.max_think_s)
        if k:
            ctx.grow(reqs[-1]["out"] + d.tokens(p.child_new_content))
            if ctx.length > p.context_cap * p.scale:
                break
        t += think
        out = d.tokens(p.child_osl, lo=p.min_osl, hi=p.max_osl)
        api = _api_time(p, d, out)
        reqs.append(_request(t, SUB_MODEL, ctx, out, think, api))
        t += api
    return {"t": round(t0, 3), "type": "subagent", "agent_id": agent_id,
            "subagent_type": "general-purpose", "status": "completed",
            "duration_ms": int(round((t - t0) * 1000)), "models": [SUB_MODEL],
            "tool_tokens": int(prefix * 0.8), "system_tokens": prefix - int(prefix * 0.8),
            "requests": reqs}


def generate_session(p: AgenticParams, seed: int, index: int,
                     params_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    d = _Draw(np.random.default_rng([seed, index]), p.scale)
    ids = _BlockIds()
    cap = p.context_cap * p.scale
    prefix = d.tokens(p.prefix)
    ctx = _Context(ids, p.block_size, prefix)
    ctx.grow(max(0, min(d.tokens(p.history, lo=0), int(0.8 * cap) - prefix)))
    n_turns = int(min(max(round(d.lognormal(p.turns)), p.min_turns), p.max_turns))
    spawn_after: dict[int, int] = {}
    if d.rng.random() < p.subagent_session_frac:
        n_groups = int(min(max(round(d.lognormal(p.groups)), 1), n_turns - 1))
        for k in d.rng.choice(n_turns - 1, size=n_groups, replace=False).tolist():
            spawn_after[k] = int(min(d.rng.geometric(p.children_p), p.max_children))
    t, reqs, agent, last_out, compactions = 0.0, [], 0, 0, 0
    for k in range(n_turns):
        think = 0.0 if k == 0 else min(d.lognormal(p.think_s), p.max_think_s)
        if k:
            delta = last_out + d.tokens(p.new_content, hi=p.max_new_content)
            if ctx.length + delta > cap:
                lo, hi = p.summary
                ctx.reset(prefix, int(d.rng.integers(lo, hi + 1) * p.scale) or 1)
                compactions += 1
            else:
                ctx.grow(delta)
        t += think
        out = d.tokens(p.osl, lo=p.min_osl, hi=p.max_osl)
        api = _api_time(p, d, out)
        reqs.append(_request(t, MAIN_MODEL, ctx, out, think, api))
        last_out = out
        t += api
        if k in spawn_after:
            children = [_child(p, d, ids, t + 0.5, f"agent-{agent + j}")
                        for j in range(spawn_after[k])]
            agent += len(children)
            reqs += children
            t = max(c["t"] + c["duration_ms"] / 1000 for c in children)
    return {"id": f"synthetic_{seed}_{index:05d}", "models": [MAIN_MODEL, SUB_MODEL],
            "block_size": p.block_size, "hash_id_scope": "local",
            "tool_tokens": int(prefix * 0.8), "system_tokens": prefix - int(prefix * 0.8),
            "requests": reqs,
            # AIPerf's schema forbids unknown top-level keys; `totals` is its opaque slot.
            "totals": {"generator": {"seed": seed, "index": index, "compactions": compactions,
                                     "params": params_dict if params_dict is not None
                                     else asdict(p)}}}


def generate_sessions(p: AgenticParams, num: int, seed: int) -> list[dict[str, Any]]:
    params = asdict(p)
    return [generate_session(p, seed, i, params) for i in range(num)]


def write_traces(sessions: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in sessions:
        path = out / f"{s['id']}.json"
        path.write_text(json.dumps(s, separators=(",", ":")))
        paths.append(path)
    return paths


def read_traces(path: str | Path) -> list[dict[str, Any]]:
    """A Weka trace file or a directory of them (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.json traces in {path}")
    traces = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}: invalid JSON ({exc})") from exc
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise ValueError(f"{f}: not a Weka trace (needs an object with 'requests')")
        traces.append(data)
    return traces


def iter_requests(trace: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """("main" | "sub", request) for every request, subagents' inner ones included."""
    for r in trace["requests"]:
        if r.get("type") == "subagent":
            for inner in r.get("requests", []):
                yield "sub", inner
        else:
            yield "main", r


def _leading_seen(ids: list[int], seen: set[int]) -> int:
    """How many leading ids are in `seen`. Ids name chained blocks (an id implies its whole
    prefix), so membership is monotone along the list and a binary search finds the edge."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _is_compaction(prev: dict[str, Any], cur: dict[str, Any], block_size: int) -> bool:
    """Whether the main turn `cur` compacted the context of `prev`: growth keeps every full
    block of the previous context (same ids, same places); a compaction keeps only the
    prefix and replaces the rest with a summary, whatever the new length."""
    keep = prev["in"] // block_size
    return cur["in"] < prev["in"] or cur["hash_ids"][:keep] != prev["hash_ids"][:keep]


def trace_stats(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape statistics of AgentX-like traces (docs/benchmarking.md), for generated or real traces.

    Ideal prefix hit: per session, an infinite cache of every block id seen so far (requests in
    time order); a request hits its leading blocks already seen (capped at its length)."""
    main_isl: list[int] = []
    main_osl: list[int] = []
    sub_isl: list[int] = []
    sub_osl: list[int] = []
    all_isl: list[int] = []
    all_osl: list[int] = []
    first_isl: list[int] = []
    turns: list[int] = []
    new_tokens: list[int] = []
    hit_frac: list[float] = []
    thinks: list[float] = []
    hit_tok = in_tok = 0
    compactions, with_sub = [], 0
    for tr in traces:
        bs = int(tr.get("block_size", 64))
        seen: set[int] = set()
        reqs = sorted(iter_requests(tr), key=lambda kr: kr[1]["t"])
        mains = [r for kind, r in reqs if kind == "main"]
        turns.append(len(mains))
        if mains:
            first_isl.append(mains[0]["in"])
        with_sub += any(kind == "sub" for kind, _ in reqs)
        compactions.append(sum(_is_compaction(a, b, bs) for a, b in zip(mains, mains[1:])))
        thinks += [r.get("think_time", 0.0) for r in mains[1:]]
        for kind, r in reqs:
            n_hit = _leading_seen(r["hash_ids"], seen)
            hit = min(n_hit * bs, r["in"])
            seen.update(r["hash_ids"][n_hit:])
            hit_tok += hit
            in_tok += r["in"]
            if kind == "main":
                new_tokens.append(r["in"] - hit)
                hit_frac.append(hit / r["in"] if r["in"] else 0.0)
            all_isl.append(r["in"])
            all_osl.append(r["out"])
            (main_isl if kind == "main" else sub_isl).append(r["in"])
            (main_osl if kind == "main" else sub_osl).append(r["out"])

    def med(x: Sequence[float]) -> float | None:
        return float(np.median(x)) if x else None

    return {
        "sessions": len(traces), "requests": len(all_isl),
        "main_requests": len(main_isl), "subagent_requests": len(sub_isl),
        "isl_median": med(all_isl), "osl_median": med(all_osl),
        "main_isl_median": med(main_isl), "main_osl_median": med(main_osl),
        "subagent_isl_median": med(sub_isl), "subagent_osl_median": med(sub_osl),
        "first_turn_isl_median": med(first_isl),
        "turns_per_session_median": med(turns),
        "main_new_tokens_median": med(new_tokens),
        "main_hit_fraction_median": med(hit_frac),
        "ideal_prefix_hit_rate": hit_tok / in_tok if in_tok else 0.0,
        "input_output_ratio": sum(all_isl) / max(sum(all_osl), 1),
        "sessions_with_subagents_frac": with_sub / len(traces) if traces else 0.0,
        "compactions_per_session": float(np.mean(compactions)) if compactions else 0.0,
        "think_time_median_s": med(thinks),
    }
