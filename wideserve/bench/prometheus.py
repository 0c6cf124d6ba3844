"""Read counters from a Prometheus text exposition (a server's GET /metrics).

Names are normalised so one client reads wideserve, vLLM and SGLang alike: the namespace
(`wideserve:`, `vllm:`, `sglang:`) and a trailing `_total` are dropped, and samples of one
name are summed over their label sets (several models or ranks). `_created` timestamps and
histogram parts (`_bucket`, `_sum`, `_count`) are skipped. Counters read by the benchmark:

    prefix_cache_queries, prefix_cache_hits                     (tokens)
    spec_decode_num_drafts, spec_decode_num_draft_tokens,
    spec_decode_num_accepted_tokens                             (vLLM's names)
    engine_step_seconds_sum, engine_step_seconds_count          (wideserve's step histogram:
                                                                 the mean step over a window)
"""
from __future__ import annotations

import re
from typing import Any

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_NAMESPACES = ("wideserve:", "vllm:", "sglang:", "wideserve_", "vllm_", "sglang_")
_SKIP_SUFFIXES = ("_created", "_bucket", "_sum", "_count")
# Histograms whose _sum and _count are kept (a mean over a window is their delta ratio).
_KEPT_HISTOGRAMS = ("engine_step_seconds",)


def normalise(name: str) -> str:
    for ns in _NAMESPACES:
        if name.startswith(ns):
            name = name[len(ns):]
            break
    return name[:-len("_total")] if name.endswith("_total") else name


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name.endswith(_SKIP_SUFFIXES) and not _kept(name):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        key = normalise(name)
        out[key] = out.get(key, 0.0) + value
    return out


def _kept(name: str) -> bool:
    base = normalise(name).rsplit("_", 1)[0]
    return base in _KEPT_HISTOGRAMS and name.endswith(("_sum", "_count"))


async def scrape(client: Any, base_url: str) -> dict[str, float] | None:
    """GET {base_url}/metrics -> parsed counters, or None when the server has none."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
    except Exception:
        return None
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text)
