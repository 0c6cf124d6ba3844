"""Weight streaming in decode, end to end (BENCHMARKS.md, "Weight streaming"): `LLM.generate`
of N requests (random 128-token prompts, greedy, EOS ignored) with the helper off, streaming
the experts only, and streaming the experts plus each MoE call's tail (the next layer's
attention weights, models/lean_decode.py), alternating per round; median wall ms.

  PYTHONPATH=. python benchmarks/weight_streaming_decode.py MODEL [--requests 1] [--rounds 4]

One torch thread bound to the first CPU this process may use, the helper on the second (as a
served engine and its front end's core). The engine is built with weight_streaming="off" and
the helper started and stopped around each run; "experts only" hides the lean loop's view of
the helper so it queues no tail.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import types

from weight_streaming import bind_compute    # this directory (sys.path[0])
from wideserve.kernels import weight_stream
from wideserve.models import lean_decode
from wideserve.serving.llm import LLM
from wideserve.types.sampling_params import SamplingParams

MODES = ("off", "experts", "experts+tail")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    helper = bind_compute(1)
    llm = LLM(a.model, dtype="bfloat16", max_model_len=1024, threads=1,
              weight_streaming="off")
    sp = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    hidden = types.SimpleNamespace(active=lambda: False, queue=weight_stream.queue)

    def run() -> tuple[float, list]:
        prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(128)]}
                   for _ in range(a.requests)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for mode in MODES:
            if mode != "off":
                weight_stream.start(helper)
            lean_decode.weight_stream = weight_stream if mode == "experts+tail" else hidden
            t, _ = run()
            weight_stream.stop()
            times[mode].append(t * 1e3)
    lean_decode.weight_stream = weight_stream
    print(f"# {a.model}; {a.requests} request(s) x {a.tokens} tokens; CLDEMOTE "
          f"{weight_stream.demotes()}; load {os.getloadavg()[0]:.2f}")
    for mode in MODES:
        print(f"{mode}: {[round(t) for t in times[mode]]} ms, median "
              f"{statistics.median(times[mode]):.0f}")


if __name__ == "__main__":
    main()
