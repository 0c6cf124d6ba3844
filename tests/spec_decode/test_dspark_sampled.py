"""End to end: with DSpark speculation, sampled outputs follow the target model's distribution.

As tests/spec_decode/test_spec_sampled.py does for MTP: a 12-token-vocabulary DeepSeek-V4.1
(config A, random DSpark stages, a Markov head that drafts likely tokens) samples 3 tokens for one prompt many times with temperature,
top-k and a repetition penalty; the exact distribution of (t1, t2, t3) is enumerated from the
reference's full forwards over every prefix (KV quantisers off on both sides); chi-square
goodness of fit on t1, t2, t3 and (t1, t2), fixed seeds."""
from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from stats_util import chi_square_pvalue

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import v41_helpers as h  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402

V = 12
PROMPT = [3, 7, 1, 9, 4]
TEMP, TOP_K, REP = 0.9, 8, 1.3
N = 600
ALPHA = 1e-3


@torch.no_grad()
def _processed_probs(m, prefixes: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + p for p in prefixes])
    with h.kv_quant_off():
        logits = m(ids).logits[:, -1].float()                                # [P, V]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for r, row in enumerate(ids.tolist()):
        seen[r, row] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / REP, logits * REP), logits)
    x = logits / TEMP
    kth = x.topk(TOP_K, dim=-1).values[:, -1:]
    return x.masked_fill(x < kth, float("-inf")).softmax(-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    kw = dict(h.A, vocab_size=V, engram_compressed_vocab_size=V, dspark_noise_token_id=V - 1,
              dspark_markov_rank=V)
    m = h.oracle_model(kw, seed=12)
    p1 = _processed_probs(m, [[]])[0]
    p2 = _processed_probs(m, [[a] for a in range(V)])
    pairs = list(itertools.product(range(V), repeat=2))
    p3 = _processed_probs(m, [list(p) for p in pairs]).reshape(V, V, V)
    be = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                       experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    torch.manual_seed(13)
    draft = DeepseekV41DSparkModel(m.config.text_config, be, num_anchors=1,
                                   enable_confidence_head=True)
    # Random stages draft arbitrary tokens (accepted ~4% of the time); a Markov head that
    # says "after a, the token most likely after a first token a" makes acceptance and
    # rejection both common (the verifier does not depend on how drafts are made).
    with torch.no_grad():
        head = draft.mtp[-1].markov_head
        head.embed.weight.copy_(torch.eye(V))
        head.head.weight.zero_()
        head.head.weight[p2.argmax(-1), torch.arange(V)] = 100.0
    path = h.save_checkpoint(m, kw, tmp_path_factory.mktemp("v41_tiny_vocab"))
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    state.update({k: v.contiguous() for k, v in draft.state_dict().items()
                  if k.startswith("mtp.")})
    save_file(state, str(path / "model.safetensors"))
    return str(path), p1[:, None, None] * p2[:, :, None] * p3


def test_sampled_tokens_follow_the_target_distribution(setup):
    path, joint = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, dtype="float32", block_size=16, skip_tokenizer_init=True,
                  kv_cache_dtype="raw", kv_cache_memory=1 << 27, max_num_seqs=200,
                  max_num_batched_tokens=2048,
                  speculative_config={"method": "dspark", "num_speculative_tokens": 2,
                                      "batch_token_budget": 0})   # full depth at batch N
    sp = SamplingParams(temperature=TEMP, top_k=TOP_K, repetition_penalty=REP, max_tokens=4,
                        ignore_eos=True)
    torch.manual_seed(0)
    with h.kv_quant_off():
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sp, use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    assert toks.shape == (N, 4)
    sd = llm.engine.get_stats().spec_decode
    assert 0.05 * sd.num_draft_tokens < sd.num_accepted_tokens < 0.95 * sd.num_draft_tokens
    marginals = {"t1": (toks[:, 0], joint.sum((1, 2))), "t2": (toks[:, 1], joint.sum((0, 2))),
                 "t3": (toks[:, 2], joint.sum((0, 1))),
                 "t1t2": (toks[:, 0] * V + toks[:, 1], joint.sum(2).reshape(-1))}
    for name, (obs, probs) in marginals.items():
        counts = torch.bincount(obs, minlength=probs.numel())
        assert chi_square_pvalue(counts, probs) > ALPHA, name
    llm.engine.check_integrity()
