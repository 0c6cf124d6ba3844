"""The captured decode step on the CPU, on vs off (BENCHMARKS.md, "Captured decode step").

  python benchmarks/history/decode_capture_ab.py MODEL {0|1} [--num-prompts 64 ...]

One offline run (token-id prompts, greedy, EOS ignored, as benchmarks/vs_vllm/offline_worker.py)
with LoadConfig.decode_capture off (0) or on (1). Prints one JSON line: output tok/s, and per
decode step the host time spent building its metadata (decode steps only) (ModelRunner.build_batch off,
CapturedDecode.stage + upload on), the runner's whole forward call, and the StepTimer phases.
Alternate the two settings in separate processes (decode_capture_ab.sh).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "vs_vllm"))
from offline_worker import prompts  # noqa: E402


class _Timed:
    """Wraps obj.name, summing its wall time and calls."""

    def __init__(self, obj, name: str, only=None) -> None:
        """only: a predicate on the call's first argument; other calls are not counted."""
        self.total, self.calls, inner = 0.0, 0, getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if only is None or only(a[0]):
                    self.total += time.perf_counter() - t
                    self.calls += 1
        setattr(obj, name, timed)

    def per_call_ms(self) -> float:
        return 1e3 * self.total / max(self.calls, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("capture", choices=["0", "1"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from wideserve import LLM, SamplingParams
    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True,
              decode_capture=args.capture == "1")
    ids = prompts(args.num_prompts, args.input_len, args.vocab, seed=0)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ids[:4]], warm, use_tqdm=False)
    runner = llm.engine.runner
    cap = runner.captured
    from wideserve.worker.decode_capture import is_decode_step
    # Decode steps only: the metadata the captured step replaces.
    meta = [_Timed(runner, "build_batch", only=is_decode_step)] if cap is None else \
        [_Timed(cap, "stage"), _Timed(cap.inputs, "upload", only=lambda n: True)]
    fwd = _Timed(runner, "forward", only=is_decode_step)
    steps0 = llm.engine.timer.stats.steps
    sec0 = dict(llm.engine.timer.stats.seconds)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    st = llm.engine.timer.stats
    steps = st.steps - steps0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({
        "decode_capture": cap is not None, "num_prompts": args.num_prompts,
        "out_tok_s": tokens / elapsed, "steps": steps,
        "metadata_ms_per_call": sum(m.per_call_ms() for m in meta),
        "decode_forward_ms_per_call": fwd.per_call_ms(),
        "phases_ms_per_step": {k: 1e3 * (v - sec0[k]) / steps for k, v in st.seconds.items()},
        "first_tokens": outs[0].outputs[0].token_ids[:8]}))


if __name__ == "__main__":
    main()
