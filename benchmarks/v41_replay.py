"""DeepSeek-V4.1 exact decoder bounded replay: prefill tokens/s on a cached prefix, before and
after, with the exactness check and a profile (BENCHMARKS.md, "DeepSeek-V4.1: exact decoder
bounded replay").

The recipe measures 4K / 32K / 64K new tokens on a 128K cached prefix of V4.1-Flash on GPUs.
Layouts (`--layout`):
- flash (default): V4.1-Flash's own layer layout at small widths: 40 layers, compress ratios
  [0, 0] + [2] x 18 + [1] x 20, KV sources 2 / 8 / 14 / 20, index sources 2 / 8 / 14 / 20 / 24 /
  28 / 32 / 36, the candidate source 20 (2,048 blocks of 8), index top-k 512, window 128,
  hc_mult 4, Engram at 1 and 14 (small tables), as in its config; narrow widths (hidden 128,
  2 heads x 32, indexer 4 x 32, 8 experts top-2) so a loaded 1-thread CPU runs 32K new tokens
  in minutes. The exact replay keeps 1 + 20 x 127 = 2,541 rows at layer 20, as on Flash.
- scaled8: the earlier 8-layer stand-in (hidden 256; 4 decoder layers).
Random (dummy) weights, fp32, KV stored as values ("raw": the same quantised values as the
packed records; unpacking FP4 records dominates a long CPU prefill), one engine with prefix
caching (prefix_window_mode "keep"), the new tokens prefilled in chunks of `--chunk` (8,192:
on Flash's layout the exact replay keeps min(chunk, 1 + (40 - l) x 127) rows at layer l >= 20,
so the engine's default 2,048 cuts only layers 24-39; one chunk's [rows x entries] fp32 mask
is 3 GiB at 8K x 96K, which rules out one step of 32K-64K rows here).

Modes, in the order given, alternating within each round; every mode of a round prefills the same new tokens
(the blocks the previous mode cached past the prefix are forgotten first):
- off: every layer on every row (`--no-decoder-bounded-replay`);
- approx: main's old `--decoder-bounded-replay` row choice: the source on every row, the
  layers after it on each request's last `window` rows (approximate; emulated through the
  replay's row-start function, same sub-batches as the old code);
- excl_source: the exact replay from the layer after the last KV source on, the source
  itself (layer 20 on Flash) on every row: the recipe's "before" (bounded replay excluding
  layer 20), made exact like ours;
- exact: the default (models/deepseek_v41/replay.py);
- topk: exact, with the indexer's long-row top-k (`index_topk`) on the keyed torch.topk (the
  path before DeepSelect, kernels/deepselect.py) instead of the DeepSelect C++ op (the
  candidate source's block choice is torch.topk in every mode).
Times (wall and process CPU time: the machine may be shared) one `generate(max_tokens=1)` per prompt (the prefill and one sampled token), and keeps
the sampled row's logits: exact, topk and off must agree within 1e-5 (the tolerance of
tests/models/test_deepseek_v41.py's replay test); approx's distance is printed for reference.
Every timed prefill is also split by part (`PartTimer`: layers by group, attention, MoE,
Engram, the indexer's scoring, top-k and candidate blocks).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/v41_replay.py \
        [--layout flash] [--new 4096 32768 65536] [--prefix 65536] [--rounds 1] \
        [--modes off approx exact topk] [--modes-last exact approx off]

Results: benchmarks/results/v41_replay_<layout>.json (V41_REPLAY_OUT overrides), written after
every prefill.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from wideserve import LLM, SamplingParams
from wideserve.bench.report import machine_info
from wideserve.layers.attention import indexer as indexer_mod
from wideserve.layers.attention import v41_batched
from wideserve.models.deepseek_v41 import replay

RESULTS = Path(__file__).parent / "results"
WINDOW = 128
COMMON = dict(vocab_size=1024, sliding_window=WINDOW, index_topk=512, qk_rope_head_dim=32,
              candidate_topk_blocks=2048, candidate_block_size=8, rms_norm_eps=1e-6,
              num_nextn_predict_layers=0, max_position_embeddings=1 << 18)
LAYOUTS = {
    "flash": dict(COMMON, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=40,
                  num_attention_heads=2, head_dim=32, q_lora_rank=64, o_groups=2,
                  o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
                  index_n_heads=4, index_head_dim=32, hc_mult=4, hc_sinkhorn_iters=20,
                  compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
                  kv_source_layer_ids=[2, 8, 14, 20],
                  index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                  candidate_source_layer_id=20, engram_layer_ids=[1, 14],
                  engram_num_embeddings=[500000, 500000], engram_vocab_size=20000,
                  engram_n_heads=8, engram_head_dim=32, engram_max_ngram_size=4,
                  engram_compressed_vocab_size=1024, qk_rope_head_dim=16),
    "scaled8": dict(COMMON, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8,
                    num_attention_heads=8, head_dim=128, q_lora_rank=128, o_groups=2,
                    o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2,
                    index_n_heads=8, index_head_dim=64, hc_mult=4, hc_sinkhorn_iters=20,
                    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 4],
                    index_source_layer_ids=[1, 4, 5, 7], candidate_source_layer_id=4,
                    engram_layer_ids=[], engram_num_embeddings=[]),
}
MODES = ("off", "approx", "excl_source", "exact", "topk")
KV_DTYPE = "raw"
TOL = 1e-5
OTHERS = ("off", "approx", "excl_source", "topk")     # the modes exact is compared with


def _source(text: dict) -> int:
    return max(text["kv_source_layer_ids"])


def _llm(tmp: Path, text: dict, chunk: int, kv_bytes: int) -> LLM:
    (tmp / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
         "text_config": text, "torch_dtype": "float32",
         "max_position_embeddings": text["max_position_embeddings"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(tmp), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                   enable_prefix_caching=True, max_num_batched_tokens=chunk,
                   kv_cache_memory=kv_bytes, max_num_seqs=4, kv_cache_dtype=KV_DTYPE)


class Modes:
    """Switches the engine's model between the modes (module doc)."""

    def __init__(self, llm: LLM, source: int) -> None:
        self.model = llm.engine.model
        self.exact_starts = replay.replay_starts
        self.deepselect = v41_batched.index_topk
        self.source = source
        self.logits: torch.Tensor | None = None
        inner = self.model.compute_logits

        def keep(hidden: torch.Tensor) -> torch.Tensor:      # the sampled row's logits
            out = inner(hidden)
            self.logits = out[-1].detach().float().clone()
            return out
        self.model.compute_logits = keep

    def _approx(self, ctx, seq, need, window, layer, num_layers):   # noqa: ANN001, ANN202
        return ctx if layer == self.source else np.maximum(ctx, seq - window)

    def _excl_source(self, ctx, seq, need, window, layer, num_layers):   # noqa: ANN001, ANN202
        return ctx if layer == self.source else self.exact_starts(ctx, seq, need, window,
                                                                  layer, num_layers)

    def set(self, mode: str) -> None:
        self.model.decoder_replay = mode != "off"
        replay.replay_starts = {"approx": self._approx, "excl_source": self._excl_source
                                }.get(mode, self.exact_starts)
        v41_batched.index_topk = (self.deepselect if mode != "topk" else
                                  lambda s, k: indexer_mod.index_topk(s, k, cpu_op=False))


def _cached(llm: LLM) -> list[set]:
    return [set(p.cached) for p in llm.engine.kv_manager.pools]


def _forget_past(llm: LLM, keep: list[set]) -> None:
    """Forget every cached block but the prefix's, so the next prompt computes its new tokens
    again (the blocks stay free, only their hashes go)."""
    for pool, kept in zip(llm.engine.kv_manager.pools, keep):
        for key in [k for k in pool.cached if k not in kept]:
            pool._evict(pool.cached[key])


def _prefill(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one prefill and its sampled token."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t, c = time.perf_counter(), time.process_time()
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return time.perf_counter() - t, time.process_time() - c


def _measure(llm: LLM, modes: Modes, keep: list[set], prefix: list[int], g, n: int,
             order: list[str], rounds: int, vocab: int, source: int, save) -> dict:   # noqa: ANN001
    """Rounds of every mode on the same new tokens; `save(row)` after each prefill."""
    row = dict(new_tokens=n, prefix=len(prefix), seconds={m: [] for m in order},
               cpu_seconds={m: [] for m in order}, parts={m: [] for m in order}, loads=[])
    for r in range(rounds):
        new = g.integers(3, vocab, n).tolist()
        got: dict[str, torch.Tensor] = {}
        for mode in (order if r % 2 == 0 else order[::-1]):
            modes.set(mode)
            _forget_past(llm, keep)
            with PartTimer(llm.engine.model, source) as timer:
                t, cpu = _prefill(llm, prefix + new)
            row["seconds"][mode].append(t)
            row["cpu_seconds"][mode].append(cpu)
            row["parts"][mode].append(timer.report(t))
            row["loads"].append(os.getloadavg()[0])
            got[mode] = modes.logits
            # kept so that runs of one mode each (in parallel processes) can be compared
            row.setdefault("sampled_logits", {})[mode] = modes.logits.tolist()
            _summarise(row, got, r)
            save(row)
    return row


def _summarise(row: dict, got: dict[str, torch.Tensor], r: int) -> None:
    """tok/s (median), exact's speed-ups, and the logit distances to the reference mode (off,
    else exact) of round r."""
    med = {m: float(np.median(t)) for m, t in row["seconds"].items() if t}
    cpu = {m: float(np.median(t)) for m, t in row["cpu_seconds"].items() if t}
    n = row["new_tokens"]
    row["tokens_per_s"] = {m: n / v for m, v in med.items()}
    row["tokens_per_cpu_s"] = {m: n / v for m, v in cpu.items()}
    for m in OTHERS:
        if m in med and "exact" in med:
            row[f"exact_over_{m}"] = med[m] / med["exact"]
            row[f"exact_over_{m}_cpu"] = cpu[m] / cpu["exact"]
    ref_mode = "off" if "off" in row["seconds"] else "exact"
    ref = got.get(ref_mode)
    diffs = row.setdefault("max_logit_diff", {})
    if ref is not None:
        for m, v in got.items():
            if m != ref_mode and len(diffs.setdefault(m, [])) <= r:
                diffs[m].append((v - ref).abs().max().item())
    exact_like = [d for m, ds in diffs.items() if m != "approx" for d in ds]
    row["reference_mode"] = ref_mode
    row["exact_within_tol"] = bool(exact_like) and max(exact_like) <= TOL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="flash", choices=sorted(LAYOUTS))
    ap.add_argument("--new", type=int, nargs="+", default=[4096, 32768, 65536])
    ap.add_argument("--prefix", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--modes-last", nargs="+", choices=MODES,
                    help="modes of the last --new entry (default: --modes)")
    ap.add_argument("--kv-gib", type=float, default=3.0)
    ap.add_argument("--chunk", type=int, default=8192,
                    help="max_num_batched_tokens: the prefill chunk (0: all new tokens in one)")
    ap.add_argument("--cache-only", action="store_true",
                    help="only cache the prefix and print its wall and CPU seconds (to A/B "
                         "the prefill code: run this file with PYTHONPATH at each tree)")
    ap.add_argument("--quant-off", action="store_true",
                    help="KV quantisers as the identity (as the replay tests run): last-bit "
                         "differences between GEMMs of different row counts cannot cross a "
                         "rounding bin")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quant_off:
        from wideserve.layers import kv_quant
        kv_quant.fake_quant = lambda x, fmt: x
    text = LAYOUTS[args.layout]
    vocab = text["vocab_size"]
    g = np.random.default_rng(0)
    prefix = g.integers(3, vocab, args.prefix).tolist()
    rows: list[dict] = []
    chunk = args.chunk or max(args.new + [args.prefix])
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(Path(tmp), text, chunk, int(args.kv_gib * (1 << 30)))
        modes = Modes(llm, _source(text))
        modes.set("exact")
        if args.cache_only:
            _prefill(llm, prefix[:256])                            # warm up
        t, cpu = _prefill(llm, prefix)                             # cache the prefix
        keep = _cached(llm)
        print(f"# {args.layout}: prefix {args.prefix} cached in {t:.1f} s, CPU {cpu:.1f} s "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        prefix_cached = dict(tokens=args.prefix, seconds=t, cpu_seconds=cpu)
        if args.cache_only:
            return
        _prefill(llm, prefix + g.integers(3, vocab, 256).tolist())   # warm up
        for i, n in enumerate(args.new):
            last = i == len(args.new) - 1 and args.modes_last
            order = list(dict.fromkeys(args.modes_last if last else args.modes))
            row = _measure(llm, modes, keep, prefix, g, n, order, args.rounds, vocab,
                           _source(text),
                           lambda r: _dump(args, text, rows + [r], prefix_cached))
            rows.append(row)
            print(f"{n:6d} new on {args.prefix}: tok/CPU-s " + "  ".join(
                f"{m} {v:7.1f}" for m, v in row["tokens_per_cpu_s"].items()) + "".join(
                f"  exact/{m} {row[f'exact_over_{m}_cpu']:.3f}x (wall "
                f"{row[f'exact_over_{m}']:.3f}x)" for m in OTHERS if f"exact_over_{m}" in row) + f"  max|dlogit| vs {row['reference_mode']} "
                f"{row['max_logit_diff']} exact {row['exact_within_tol']}  "
                f"(load {min(row['loads']):.1f}-{max(row['loads']):.1f})", flush=True)
            for m, parts in row["parts"].items():
                _print_profile(m, n, parts[-1])
        modes.set("exact")
    print(f"wrote {_out(args.layout)}")


class PartTimer:
    """Wall seconds of one prefill by part, inclusive, split by layer group (enc: before the
    last KV source, src: the source, dec: after it): each block, its attention, MoE and
    Engram (module hooks), and inside attention the indexer's entry scoring, the candidate
    source's block choice, the reindex layers' candidate scoring and the top-k (wrapped
    v41_batched functions); plus Engram hashing, the replay plan and the whole forward."""

    FUNCS = ("_entry_scores", "_candidate_scores", "_candidate_blocks", "index_topk")

    def __init__(self, model: torch.nn.Module, source: int) -> None:
        self.model, self.source = model, source
        self.t: dict[str, float] = {}
        self.layer = -1

    def group(self) -> str:
        return ("enc" if self.layer < self.source else
                "src" if self.layer == self.source else "dec")

    def _add(self, name: str, dt: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + dt

    def _wrap(self, name: str, fn, grouped: bool = True):   # noqa: ANN001, ANN202
        def timed(*a, **kw):   # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._add(f"{self.group()} {name}" if grouped else name,
                          time.perf_counter() - t0)
        return timed

    def __enter__(self) -> PartTimer:
        from wideserve.models.deepseek_v41 import model as v41_model
        self.saved = {f: getattr(v41_batched, f) for f in self.FUNCS}
        for f in self.FUNCS:
            setattr(v41_batched, f, self._wrap(f.strip("_"), self.saved[f]))
        self.saved_plan = v41_model.plan_decoder_replay
        v41_model.plan_decoder_replay = self._wrap("replay plan", self.saved_plan, False)
        m = self.model
        for name in ("forward", "_engram_rows"):
            setattr(m, name, self._wrap(name.strip("_"), getattr(m, name), False))
        self.hooks = []
        for i, block in enumerate(m.model.layers):
            def enter(mod, args, i=i):   # noqa: ANN001, ANN202
                self.layer, mod._t0 = i, time.perf_counter()

            def leave(mod, args, out, part="block"):   # noqa: ANN001, ANN202
                self._add(f"{self.group()} {part}", time.perf_counter() - mod._t0)
            self.hooks += [block.register_forward_pre_hook(enter),
                           block.register_forward_hook(leave)]
            for part in ("attn", "ffn", "engram"):
                sub = getattr(block, part, None)
                if sub is None:
                    continue
                self.hooks += [sub.register_forward_pre_hook(
                    lambda mod, args: setattr(mod, "_t0", time.perf_counter())),
                    sub.register_forward_hook(lambda mod, a, o, part=part: leave(mod, a, o, part))]
            if i == self.source:
                block.write_shared_kv = self._wrap("write_shared_kv", block.write_shared_kv)
        return self

    def __exit__(self, *exc: object) -> None:
        from wideserve.models.deepseek_v41 import model as v41_model
        for f, fn in self.saved.items():
            setattr(v41_batched, f, fn)
        v41_model.plan_decoder_replay = self.saved_plan
        for name in ("forward", "_engram_rows", "write_shared_kv"):
            self.model.__dict__.pop(name, None)
            for block in self.model.model.layers:
                block.__dict__.pop(name, None)
        for h in self.hooks:
            h.remove()

    def report(self, total: float) -> dict[str, float]:
        return dict(sorted({"generate": total, **self.t}.items(), key=lambda kv: -kv[1]))


def _print_profile(mode: str, n: int, parts: dict[str, float]) -> None:
    total = parts["generate"]
    print(f"# parts: {mode}, {n} new tokens, {total:.1f} s")
    for name, sec in parts.items():
        print(f"  {name:28s} {sec:8.2f} s  {100 * sec / total:5.1f}%")


def _out(layout: str) -> Path:
    return Path(os.environ.get("V41_REPLAY_OUT", RESULTS / f"v41_replay_{layout}.json"))


def _dump(args: argparse.Namespace, text: dict, rows: list, prefix_cached: dict) -> None:
    out = _out(args.layout)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_info(), layout=args.layout,
                                   source=_source(text), window=WINDOW, text_config=text,
                                   rounds=args.rounds, threads=args.threads, chunk=args.chunk,
                                   quant_off=args.quant_off, prefix_cached=prefix_cached,
                                   rows=rows),
                          indent=1))


if __name__ == "__main__":
    main()
