"""Greedy outputs with DEP2 / DEP4 (N engine-core processes, experts sharded, all-to-all MoE)
equal one process's, token for token, on a Qwen3-MoE checkpoint, a dummy DeepSeek-V4 and the
bundled model, with uneven load (ranks idle for many steps: dummy batches), prefix-cache hits,
chunked prefill, preemption and MTP speculation."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from dist_utils import free_port_block
from tiny_families import qwen3_moe_checkpoint
from wideserve import LLM, SamplingParams

SHORT, LONG = 2, 10


def _prompts(vocab: int, block: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(2, vocab, (2 * block + 3,), generator=gen).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (5, 23, 9, 40, 17, 30)]
    return prompts + [shared + torch.randint(2, vocab, (n,), generator=gen).tolist()
                      for n in (4, 7, 2, 11, 6, 9)]


def _params(n: int) -> list[SamplingParams]:
    # The balancer alternates ranks; odd requests end early so their rank runs dummy batches.
    return [SamplingParams(temperature=0.0, max_tokens=LONG if i % 2 == 0 else SHORT,
                           ignore_eos=True) for i in range(n)]


def _run(model: str | None, dp: int, prompts, ep: bool = True, **kw
         ) -> tuple[list[list[int]], dict]:
    args = dict(dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=True, **kw)
    if dp > 1:
        args.update(data_parallel_size=dp, enable_expert_parallel=ep,
                    data_parallel_rpc_port=free_port_block(2 + 2 * dp), dp_sync_timeout_s=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, **args)
    try:
        # Two waves: the second's shared-prefix prompts hit the cache the first filled.
        half = len(prompts) // 2
        outs = []
        for wave in (prompts[:half], prompts[half:]):
            outs += llm.generate([{"prompt_token_ids": p} for p in wave], _params(len(wave)),
                                 use_tqdm=False)
        stats = llm.engine.get_stats() if dp > 1 else {}
        if dp > 1:
            llm.engine.check_integrity()
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


def _check(stats: dict, dp: int) -> None:
    ranks = stats["per_rank"]
    assert len(ranks) == dp
    assert all(r["dp"]["lockstep"] and r["dp"]["num_local_experts"] > 0 for r in ranks)
    assert sum(r["dp"]["dummy_steps"] for r in ranks) > 0, "no rank ever idled"
    assert all(r["generation_tokens"] > 0 for r in ranks), "a rank got no requests"
    assert stats["prefix_hits"] > 0


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe"), vocab_size=160, hidden_size=48,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False)


def test_dep2_qwen3_moe_chunked_prefix_preemption(qwen3_moe_dir):
    kw = dict(block_size=16, max_num_batched_tokens=32, num_blocks_override=5)
    prompts = _prompts(160, 16)
    expected, _ = _run(qwen3_moe_dir, 1, prompts, **kw)
    got, stats = _run(qwen3_moe_dir, 2, prompts, **kw)
    assert got == expected, [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    _check(stats, 2)
    assert stats["num_preemptions"] > 0, [r["num_preemptions"] for r in stats["per_rank"]]


def test_dp2_without_expert_parallel_runs_independent_ranks(qwen3_moe_dir):
    # No EP: nothing is shared during a step, so no group and no lock-step (as in vLLM).
    prompts = _prompts(160, 16)[:4]
    expected, _ = _run(qwen3_moe_dir, 1, prompts, block_size=16)
    got, stats = _run(qwen3_moe_dir, 2, prompts, ep=False, block_size=16)
    assert got == expected
    assert [r["dp"]["lockstep"] for r in stats["per_rank"]] == [False, False]
    assert all(r["generation_tokens"] > 0 for r in stats["per_rank"])


def test_dep4_dummy_v4_mtp(tmp_path):
    from models import v4_configs
    cfg = {**v4_configs.A, "num_nextn_predict_layers": 1,
           "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", block_size=16, max_num_batched_tokens=24,
              kv_cache_memory=1 << 24,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts = _prompts(256, 16)
    expected, _ = _run(str(tmp_path), 1, prompts, **kw)
    got, stats = _run(str(tmp_path), 4, prompts, **kw)
    assert got == expected
    _check(stats, 4)
    assert stats["spec_decode"]["num_drafts"] > 0


def test_dep2_bundled_model_mtp():
    kw = dict(block_size=32, max_num_batched_tokens=48, kv_cache_memory=1 << 24, max_num_seqs=8,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompts = _prompts(4096, 32)
    expected, _ = _run(None, 1, prompts, **kw)
    got, stats = _run(None, 2, prompts, **kw)
    assert got == expected
    _check(stats, 2)
