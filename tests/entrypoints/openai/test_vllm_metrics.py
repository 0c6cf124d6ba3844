"""vLLM-named metric aliases: computed from the same registry, so they always agree."""
from __future__ import annotations

from wideserve.entrypoints.openai.metrics import ServerMetrics


def test_spec_decode_and_request_success_under_vllm_names():
    stats = {"num_running": 2, "spec_decode": {
        "num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5,
        "num_accepted_tokens_per_pos": [3, 2, 0]}}
    m = ServerMetrics("m", lambda: stats)
    m.observe_finish("stop", 0.5)
    m.observe_rejected()
    lines = m.render().decode().splitlines()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' \
        in lines
    assert 'vllm:num_requests_running{model_name="m"} 2.0' in lines
    assert 'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0' in lines
    assert not any(line.startswith("vllm:") and "rejected" in line for line in lines)
