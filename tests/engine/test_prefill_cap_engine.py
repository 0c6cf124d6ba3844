"""The prefill cap a CPU engine measures at start (SchedulerConfig.max_prefill_tokens "auto",
worker/prefill_cap.py): timed on the model as loaded, applied to scheduling, greedy outputs
unchanged; no measurement (and no cap) where the engine does not warm up."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.worker import prefill_cap


def _checkpoint(tmp_path, dtype):
    from tiny_families import qwen3_moe_checkpoint
    return qwen3_moe_checkpoint(
        tmp_path, dtype, vocab_size=96, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False)


def _llm(path, dtype: str, cap) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, dtype=dtype, block_size=16, kv_cache_memory=1 << 24,
                   skip_tokenizer_init=True, max_num_batched_tokens=256,
                   max_prefill_tokens=cap)


PROMPTS = [[(7 * i + 3 * j) % 95 + 1 for j in range(40 + 9 * i)] for i in range(6)]


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_auto_is_measured_at_start_and_applied(tmp_path, monkeypatch, caplog) -> None:
    path = _checkpoint(tmp_path, torch.bfloat16)
    seen: dict[int, float] = {}
    real_measure = prefill_cap.measure

    def measure(*a, **k):
        seen.update(real_measure(*a, **k))
        return seen
    monkeypatch.setattr(prefill_cap, "measure", measure)
    # The choice itself is tested on given timings (test_scheduler_prefill_cap.py); here the
    # engine must apply whatever it returns: force a split that shows in the steps.
    monkeypatch.setattr(prefill_cap, "choose_cap", lambda times, budget: 64)
    with caplog.at_level(logging.INFO, logger="wideserve.engine.engine_core"):
        llm = _llm(path, "bfloat16", "auto")
    assert sorted(seen) == [64, 128, 256] and all(t > 0 for t in seen.values())
    assert llm.engine.scheduler.config.max_prefill_tokens == 64
    assert any("prefill cap: 64 tokens per step" in r.getMessage() and "256:" in r.getMessage()
               for r in caplog.records)
    steps = []
    real_schedule = llm.engine.scheduler.schedule

    def schedule():       # prompt tokens per step (schedule() has advanced the counts)
        out = real_schedule()
        steps.append(sum(s.num_new_tokens for s in out.scheduled if s.request.num_tokens
                         - (s.request.num_computed_tokens - s.num_new_tokens) > 1))
        return out
    monkeypatch.setattr(llm.engine.scheduler, "schedule", schedule)
    capped = _greedy(llm)
    assert max(steps) == 64 and sum(steps) == sum(map(len, PROMPTS))
    assert capped == _greedy(_llm(path, "bfloat16", 0))


def test_no_measurement_where_the_engine_does_not_warm_up(tmp_path, monkeypatch,
                                                         caplog) -> None:
    path = _checkpoint(tmp_path, torch.float32)
    monkeypatch.setattr(prefill_cap, "measure",
                        lambda *a, **k: pytest.fail("fp32 engines do not measure"))
    with caplog.at_level(logging.INFO, logger="wideserve.engine.engine_core"):
        llm = _llm(path, "float32", "auto")
    assert llm.engine.scheduler.config.max_prefill_tokens == 0
    assert any("prefill cap: none (not measured here" in r.getMessage()
               for r in caplog.records)
