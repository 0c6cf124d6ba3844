"""Tokenising a long text without stalling the event loop: inline, in a thread (`encode`,
which holds the GIL; `encode_batch`, which releases it), or in a worker process. Reports the
time, the worst delay of a 5 ms loop ticker, and this process's RSS after (issue 15).

    OMP_NUM_THREADS=1 python benchmarks/history/tokenize_offload.py [--words 1000000]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import time
from pathlib import Path

import tokenizers

TOKENIZER = Path(__file__).resolve().parents[2] / \
    "wideserve/assets/shakespeare-v4-tiny/tokenizer.json"
_worker: tokenizers.Tokenizer | None = None


def _rss_mb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 >> 20


def _init() -> None:
    global _worker
    _worker = tokenizers.Tokenizer.from_file(str(TOKENIZER))


def _count_in_worker(text: str) -> int:
    assert _worker is not None
    return len(_worker.encode_batch([text], add_special_tokens=False)[0])


async def _one(mode: str, tok: tokenizers.Tokenizer, text: str,
               pool: concurrent.futures.Executor) -> str:
    worst, stop = 0.0, asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t - 0.005)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    rss0, t = _rss_mb(), time.perf_counter()
    if mode == "inline":
        n = len(tok.encode(text, add_special_tokens=False).ids)
    elif mode == "thread-encode":
        n = len(await asyncio.to_thread(lambda: tok.encode(text, add_special_tokens=False).ids))
    elif mode == "thread-encode_batch":
        n = len(await asyncio.to_thread(
            lambda: tok.encode_batch([text], add_special_tokens=False)[0].ids))
    else:
        n = await asyncio.get_running_loop().run_in_executor(pool, _count_in_worker, text)
    took = time.perf_counter() - t
    stop.set()
    await tick
    return (f"{mode:20s} {n} tokens in {took:5.2f} s; worst loop delay {worst * 1000:6.0f} ms;"
            f" RSS {rss0} -> {_rss_mb()} MB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=1_000_000)
    args = ap.parse_args()
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    text = "word " * args.words
    pool = concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn"),
                                                  initializer=_init)
    pool.submit(len, "").result()
    try:
        # The worker first: the in-process modes grow this process's RSS for good.
        for mode in ("worker-process", "inline", "thread-encode", "thread-encode_batch"):
            print(asyncio.run(_one(mode, tok, text, pool)), flush=True)
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
