"""EPLB under DEP (real engine-core processes, experts sharded, all-to-all MoE): with
redundant experts and rebalances every few steps, greedy outputs equal one process's (which
runs without EPLB) before, during and after the rebalances; weights moved between ranks; and
afterwards every rank's slots hold the loaded weights of the experts its map names
(check_integrity compares load-time fingerprints gathered from all ranks)."""
from __future__ import annotations

import json
import time
import warnings

import torch

from ep_harness import free_port_block
from wideserve import LLM, SamplingParams

EPLB = {"window_size": 4, "step_interval": 5, "num_redundant_experts": 4,
        "layers_per_step": 1, "log_balancedness": True, "log_balancedness_interval": 3}


def _prompts(vocab: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (int(k),), generator=gen).tolist()
            for k in torch.randint(4, 40, (n,), generator=gen)]


def _generate(model: str | None, prompts, dp: int, **kw) -> tuple[list[list[int]], dict]:
    args = dict(dtype="float32", skip_tokenizer_init=True, **kw)
    if dp > 1:
        args.update(data_parallel_size=dp, enable_expert_parallel=True, enable_eplb=True,
                    eplb_config=EPLB, data_parallel_rpc_port=free_port_block(2 + 2 * dp),
                    dp_sync_timeout_s=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, **args)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = _settled_stats(llm) if dp > 1 else {}
        if dp > 1:
            llm.engine.check_integrity()        # every rank: KV and expert weights
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


def _settled_stats(llm: LLM) -> dict:
    """The ranks' stats once they agree on the EPLB step count: the last outputs can reach
    us while a rank is still finishing the group's final lock-step iteration."""
    deadline = time.monotonic() + 60         # a deadline, not a count: a loaded machine
    while True:                              # may take seconds for that last iteration
        stats = llm.engine.get_stats()
        if len({r["eplb"]["target"]["steps"] for r in stats["per_rank"]}) == 1:
            return stats
        if time.monotonic() > deadline:
            return stats                     # the assertions then say what disagrees
        time.sleep(0.1)


def _check_rebalanced(stats: dict, roles: set[str]) -> None:
    ranks = stats["per_rank"]
    for role in roles:
        per = [r["eplb"][role] for r in ranks]
        assert all(p["rebalances"] >= 2 for p in per), per        # several: during + after
        assert len({p["rebalances"] for p in per}) == 1, "ranks disagree on the schedule"
        assert sum(p["bytes_sent"] for p in per) > 0, f"{role}: no weights moved"
        # Measured over the EP group's window (all-reduced): the same number on every rank.
        assert len({p["balancedness"] for p in per}) == 1 and 0 < per[0]["balancedness"] <= 1
        assert per[0]["balancedness_steps"] > 0


def test_dep2_bundled_model_mtp_eplb():
    kw = dict(block_size=32, max_num_batched_tokens=64, kv_cache_memory=1 << 24,
              max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompts = _prompts(4096, 8)
    expected, _ = _generate(None, prompts, 1, **kw)
    got, stats = _generate(None, prompts, 2, **kw)
    assert got == expected
    _check_rebalanced(stats, {"target", "draft"})


def test_dep4_dummy_qwen3_moe_eplb(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "vocab_size": 160, "hidden_size": 48, "intermediate_size": 96,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", block_size=16, max_num_batched_tokens=48,
              kv_cache_memory=1 << 22)
    prompts = _prompts(160, 12)
    expected, _ = _generate(str(tmp_path), prompts, 1, **kw)
    got, stats = _generate(str(tmp_path), prompts, 4, **kw)
    assert got == expected
    _check_rebalanced(stats, {"target"})
