"""Model shapes come from the real config and KV spec."""
from __future__ import annotations

from pathlib import Path

import pytest

from wideserve.sim.model import attention_layout, load_model

DATA = Path(__file__).resolve().parents[1] / "data"


def test_v41_flash_kv_bytes_from_the_real_spec_and_layout():
    m = load_model(DATA / "deepseek-v41-flash")
    assert m.kv_bytes_per_token == 890            # docs/deepseek_v41.md: 2.5 entries x 356 B
    assert m.record_bytes["compressed"] == 288 and m.record_bytes["indexer"] == 68
    assert (m.layers, m.experts, m.top_k, m.draft_layers, m.draft_experts) == (40, 384, 6, 3, 128)
    assert m.draft_parallel
    scans = [a.scan for a in m.attn]
    assert scans.count("all") == 4 and scans.count(16384) == 4     # sources, reindex layers
    assert m.attn[0].ratio == 0 and m.attn[25].entries(131072) == 512
    # the indexer's work grows with context only on the source layers
    assert m.attn[2].scanned(1_000_000) == 500_000 and m.attn[24].scanned(1_000_000) == 16384


def test_plain_gqa_reads_its_whole_context():
    lay = attention_layout({"model_type": "qwen3_moe", "num_hidden_layers": 3})
    assert [a.entries(100) for a in lay] == [100, 100, 100]


def test_unknown_weight_format_is_rejected_by_the_cli_choices():
    from wideserve.entrypoints import cli
    with pytest.raises(SystemExit):
        cli.build_parser(["simulate"]).parse_args(
            ["simulate", "run", "m", "--profile", "p", "--weight-format", "fp3"])
