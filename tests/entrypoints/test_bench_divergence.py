"""`bench throughput --backend both` explains each request whose greedy output differs from
transformers' (it used to print "identical greedy outputs 4/8" and nothing else): the first
differing token and its cause, from transformers' own logits there."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from wideserve.entrypoints.bench_throughput import _divergence_line, _divergences
from wideserve.entrypoints.cli import main as cli_main


class _FakeHF(torch.nn.Module):
    """Logits for tokens 0..3; whether Tensor.topk breaks a tie by lowest index decides
    between two score rows (as an indexer's selection would)."""

    def __init__(self, default: list[float], lowest_index: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.default, self.lowest_index = default, lowest_index

    def forward(self, input_ids, use_cache=False):
        tie = torch.tensor([1.0, 3.0, 3.0, 3.0]).topk(1).indices.item()
        row = self.lowest_index if tie == 1 else self.default
        return SimpleNamespace(logits=torch.tensor([[row]]))


def _request():
    return SimpleNamespace(prompt_token_ids=[0, 1])


def test_causes() -> None:
    same = [[0, 1, 2]]
    # transformers picked 1, wideserve 2; equal ordering either way, gap 5: a real difference
    clear = _divergences(_FakeHF([0, 6, 1, 0], [0, 6, 1, 0]), [_request()], [[0, 2, 2]],
                         same, torch.float32)
    assert clear[0]["position"] == 1 and clear[0]["cause"] == "difference"
    assert clear[0]["logit_gap"] == 5.0
    # a gap of one bf16 step at magnitude 8: rounding decides
    near = _divergences(_FakeHF([0, 8, 7.9375, 0], [0, 8, 7.9375, 0]), [_request()],
                        [[0, 2, 2]], same, torch.bfloat16)
    assert near[0]["cause"] == "near tie"
    # under lowest-index ties transformers itself prefers wideserve's token
    order = _divergences(_FakeHF([0, 6, 1, 0], [0, 1, 6, 0]), [_request()], [[0, 2, 2]],
                         same, torch.float32)
    assert order[0]["cause"] == "tie order" and order[0]["logit_gap_stable_topk"] == -5.0
    assert _divergences(_FakeHF([0, 6, 1, 0], [0, 6, 1, 0]), [_request()], same, same,
                        torch.float32) == []
    line = _divergence_line(clear + near + order, "bfloat16")
    assert "1 from transformers' order among tied indexer scores" in line
    assert "1 at a near tie" in line and "bfloat16 rounding" in line
    assert "1 at a clear margin (largest 5" in line


def test_bundled_model_differences_are_explained(tmp_path, capsys) -> None:
    out = tmp_path / "t.json"
    assert cli_main(["bench", "throughput", "--backend", "both", "--num-prompts", "4",
                     "--input-len", "16", "--output-len", "48", "--threads", "1",
                     "--no-progress", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["divergence"]) == res["num_requests"] - res["identical_outputs"]
    for d in res["divergence"]:
        ws = res["wideserve_outputs"][d["request"]]
        assert ws[d["position"]] == d["wideserve_token"] != d["transformers_token"]
        assert d["cause"] in ("tie order", "near tie", "difference")
    printed = capsys.readouterr().out
    if res["divergence"]:
        assert f"the {len(res['divergence'])} that differ part at their first" in printed
