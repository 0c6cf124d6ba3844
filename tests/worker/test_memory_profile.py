"""KV sizing after a maximal dummy step (worker/memory_profile.py), run on CPU with a
stand-in for the accelerator's memory statistics: the dummy step is the largest the
scheduler can build, the budget arithmetic is vLLM's, and serving is unchanged."""
from __future__ import annotations

import pytest

from wideserve import LLM, SamplingParams
from wideserve.config import SchedulerConfig
from wideserve.worker import memory_profile
from wideserve.worker.model_runner import ModelRunner

MIB = 1 << 20
ARGS = dict(dtype="float32", block_size=64, max_num_batched_tokens=96, max_num_seqs=4,
            skip_tokenizer_init=True, gpu_memory_utilization=0.9)


class FakeMemory:
    """Pretends to be a 64 MiB device with 4 MiB in use; the step peaks 3 MiB above base."""

    def __init__(self, activation: int = 3 * MIB) -> None:
        self.activation, self.calls = activation, []

    def settle(self) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: return 60 * MIB, 64 * MIB
    def allocated(self) -> int: return 10 * MIB
    def reset_peak(self) -> None: self.calls.append("reset")
    def peak(self) -> int: return 10 * MIB + self.activation


def test_dummy_lengths_fill_the_step():
    assert memory_profile.dummy_lengths(SchedulerConfig(max_num_batched_tokens=96,
                                                        max_num_seqs=4), 4096) == [24] * 4
    assert memory_profile.dummy_lengths(SchedulerConfig(max_num_batched_tokens=10,
                                                        max_num_seqs=64), 4096) == [1] * 10
    # Longer than a request may be: more requests, never past max_model_len - 1.
    assert memory_profile.dummy_lengths(SchedulerConfig(max_num_batched_tokens=300,
                                                        max_num_seqs=1), 101) == [100]
    assert memory_profile.dummy_lengths(SchedulerConfig(max_num_batched_tokens=300,
                                                        max_num_seqs=8), 101) == [38] * 4 + [37] * 4


def test_kv_budget_after_a_maximal_step(monkeypatch):
    fake = FakeMemory()
    monkeypatch.setattr(memory_profile.DeviceMemory, "for_device", staticmethod(lambda d: fake))
    steps: list[list[int]] = []
    real = ModelRunner.forward

    def forward(self, reqs, *a, **k):
        steps.append([len(r.token_ids) for r in reqs])
        return real(self, reqs, *a, **k)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    llm = LLM(None, **ARGS)
    monkeypatch.setattr(ModelRunner, "forward", real)
    assert steps[0] == [24, 24, 24, 24]                    # the dummy step, before serving
    report = llm.engine.memory_report
    assert report.activation_peak == 3 * MIB and report.used_before == 4 * MIB
    assert report.budget == int(64 * MIB * 0.9) - 4 * MIB - 3 * MIB
    assert llm.engine.kv_config.budget_bytes == report.budget
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()                           # the real cache is untouched
    plain = LLM(None, **ARGS, kv_cache_memory=report.budget)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(10, 90))}]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]


def test_no_room_left_is_a_clear_error(monkeypatch):
    fake = FakeMemory(activation=60 * MIB)
    monkeypatch.setattr(memory_profile.DeviceMemory, "for_device", staticmethod(lambda d: fake))
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 leaves no memory"):
        LLM(None, **ARGS)


def test_cpu_has_no_memory_statistics():
    import torch
    assert memory_profile.DeviceMemory.for_device(torch.device("cpu")) is None
