"""Random sampling's cost per step: the one-uniform-per-row inverse-CDF draw the sampler
uses (worker/sampler.py, sample_categorical) against the exponential race it replaced
(argmax(p / E), one Exp(1) draw per token), and the whole Sampler call at temperature 1.0
against greedy, at the bundled models' vocabulary (4,096) and Qwen3's (151,936), 1 thread.
Then top-p: apply_top_k_top_p through the most probable candidates against the sort of the
whole vocabulary it falls back to, on logits N(0, s^2) per row: s = 6 (a nucleus of tens of
tokens at p = 0.95, as a language model's usually is) and s = 3 (thousands: the fallback).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sampling.py OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def _ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):                 # the least-disturbed of 3 repetitions of `reps` calls
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return 1e3 * best


def exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """The draw before (the reference): one Exp(1) per token, the argmax of p / E."""
    noise = torch.empty_like(probs).exponential_()
    return probs.div(noise.clamp_min_(1e-10)).argmax(dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from wideserve.types.sampling_params import SamplingParams
    from wideserve.worker.sampler import Sampler, build_sampling_metadata, sample_categorical
    rows = []
    for vocab in (4096, 151936):
        for batch in (1, 4, 16, 64):
            reps = max(2, int(2e6 // (vocab * batch)))
            logits = torch.randn(batch, vocab)
            probs = logits.softmax(-1)
            metas = {t: build_sampling_metadata(
                [SamplingParams(temperature=t)] * batch, [[]] * batch, [[0]] * batch, {},
                torch.device("cpu"), vocab) for t in (0.0, 1.0)}
            sampler = Sampler()
            row = {"vocab": vocab, "batch": batch,
                   "race_ms": _ms(lambda: exponential_race(probs), reps),
                   "draw_ms": _ms(lambda: sample_categorical(probs, {}), reps),
                   "sampler_greedy_ms": _ms(lambda: sampler(logits, metas[0.0]), reps),
                   "sampler_t1_ms": _ms(lambda: sampler(logits, metas[1.0]), reps)}
            rows.append(row)
            print(f"vocab {vocab:6d} batch {batch:2d}: draw {row['draw_ms']:.3f} ms vs race "
                  f"{row['race_ms']:.3f} ms ({row['race_ms'] / row['draw_ms']:.1f}x); "
                  f"Sampler at temperature 1.0 {row['sampler_t1_ms']:.3f} ms, greedy "
                  f"{row['sampler_greedy_ms']:.3f} ms", flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "top_p": top_p_rows(),
                                          "load_end": os.getloadavg()[0],
                                          "torch": torch.__version__}, indent=1))


def top_p_rows() -> list[dict]:
    import wideserve.worker.sampler as sampler
    out = []
    for vocab in (8192, 151936):
        for batch in (1, 16, 64):
            for scale in (6.0, 3.0):
                g = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, vocab, generator=g) * scale
                p = torch.full((batch,), 0.95)
                reps = max(1, int(2e6 // (vocab * batch)))
                fast = _ms(lambda: sampler.apply_top_k_top_p(x, None, vocab, p), reps)
                kept = int((sampler.apply_top_k_top_p(x, None, vocab, p) > float("-inf"))
                           .sum()) // batch
                slow = _ms(lambda: sampler.top_k_top_p_by_sort(x, None, p), reps)
                out.append({"vocab": vocab, "batch": batch, "scale": scale,
                            "nucleus_per_row": kept, "candidates_ms": fast, "sort_ms": slow})
                print(f"top-p 0.95 vocab {vocab:6d} batch {batch:2d} s={scale:.0f} (nucleus "
                      f"~{kept}): {fast:.2f} ms vs sort {slow:.2f} ms "
                      f"({slow / fast:.2f}x)", flush=True)
    return out


if __name__ == "__main__":
    main()
