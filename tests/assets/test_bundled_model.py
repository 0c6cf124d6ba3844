"""The shipped model, through the whole engine: its held-out perplexity matches the model
card (the engine's forward is right on real trained weights), and its greedy output equals
transformers' on the same checkpoint."""
from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.worker.model_loader import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 256


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads((BUNDLED_MODEL / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", max_num_batched_tokens=8 * (WINDOW + 1),
               max_num_seqs=16, enable_prefix_caching=False)


def _held_out() -> list[int]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from tiny_data import held_out_stream
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return held_out_stream(str(BUNDLED_MODEL)).tolist()


def test_perplexity_matches_model_card(llm, card):
    """Card protocol (README, Evaluation): window i feeds tokens [256i, 256i+256) with a fresh
    context and scores the next tokens; here each window is a 257-token prompt whose prompt
    logprobs are exactly those 256 targets."""
    val = _held_out()
    n = (len(val) - 1) // WINDOW
    assert n == card["windows"]
    prompts = [{"prompt_token_ids": val[i * WINDOW:(i + 1) * WINDOW + 1]} for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                temperature=0.0), use_tqdm=False)
    nll, count = 0.0, 0
    for out, p in zip(outs, prompts):
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == WINDOW + 1
        for pos in range(1, WINDOW + 1):
            nll -= lps[pos][p["prompt_token_ids"][pos]].logprob
            count += 1
    assert count == card["targets"]
    ppl = math.exp(nll / count)
    assert abs(ppl / card["val_ppl"] - 1) < 0.02, (ppl, card["val_ppl"])
    llm.engine.check_integrity()


def test_greedy_equals_transformers(llm):
    from transformers import DeepseekV4ForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = DeepseekV4ForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    texts = ["ROMEO.\n", "KING HENRY.\nMy lord,", "To be, or not to be,"]
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()
    assert all(o.outputs[0].text for o in outs)
