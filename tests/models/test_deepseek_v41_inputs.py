"""DeepSeek-V4.1 inputs the reference (nemo-automodel 0.7.0) handles in its own way, checked
against it (v41_helpers.py):

- a head dim that is not a multiple of FP8's group of 32 (48): the reference zero-pads the last
  group of every quantised record; wideserve's records do the same, and the logits agree with
  the reference's in fp32 (quantisers off: |d| <= 1e-4, on: the rounding-bin bound of
  test_deepseek_v41.py);
- layer layouts the reference refuses are refused at config load with the layer and the rule
  (each layout shown refused by the reference's own config too).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import v41_helpers as h
from paged_harness import PagedHarness

TOL = 1e-4
TOL_QUANT = 3e-2       # test_deepseek_v41.py's module docstring: one FP8 bin, ~1e-2 on logits

# Config A with a head dim of 48: FP8 window records of 48 channels (one group of 32 and one
# of 16 zero-padded), NVFP4 entries of 3 groups of 16.
A48 = dict(h.A, head_dim=48)


@pytest.fixture(scope="module")
def a48(tmp_path_factory):
    m = h.oracle_model(A48, seed=5)
    path = h.save_checkpoint(m, A48, tmp_path_factory.mktemp("v41_hd48"))
    seqs = [h.random_tokens(n, seed=40 + i) for i, n in enumerate((37, 29))]
    refs = {"on": [h.oracle_logits(m, s) for s in seqs]}
    with h.kv_quant_off():
        refs["off"] = [h.oracle_logits(m, s) for s in seqs]
    assert all(r.std() > 0.3 for r in refs["on"]), "logits too flat for a check"
    return h.ws_model(path), seqs, refs


def _run(ws, seqs, plans, kv: str) -> list[torch.Tensor]:
    """Both requests together, each by its chunk plan then one token per step; the logits of
    every row, per request."""
    hr = PagedHarness(ws, max_reqs=2, max_len=max(map(len, seqs)) + 4,
                      specs=ws.kv_cache_specs(kv))
    steps = [list(p) + [1] * (len(s) - sum(p)) for p, s in zip(plans, seqs)]
    done, rows = [0, 0], [[], []]
    for i in range(max(map(len, steps))):
        slots = [r for r in (0, 1) if i < len(steps[r])]
        chunks = [seqs[r][done[r]:done[r] + steps[r][i]] for r in slots]
        out = hr.step(slots, chunks)
        at = 0
        for r, chunk in zip(slots, chunks):
            rows[r].append(out[at:at + len(chunk)])
            at += len(chunk)
            done[r] += len(chunk)
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("quant", ["off", "on"])
def test_head_dim_48_matches_the_reference(a48, quant):
    ws, seqs, refs = a48
    assert ws.config.head_dim == 48
    window = ws.kv_cache_specs("auto")["model.layers.0.attn.window"]
    assert window.entry_bytes == 48 + 2                  # 48 FP8 codes + 2 UE8M0 scales
    kv = "raw" if quant == "off" else "auto"
    ctx = h.kv_quant_off() if quant == "off" else contextlib.nullcontext()
    with ctx:
        for plans in (([37], [29]), ([5, 7, 3, 11], [9, 2, 6])):
            outs = _run(ws, seqs, plans, kv)
            worst = max((o - r).abs().max().item() for o, r in zip(outs, refs[quant]))
            assert worst <= (TOL if quant == "off" else TOL_QUANT), (plans, worst)


# Layouts the reference refuses: (changes to config A, wideserve's message, the reference's
# message, where the reference refuses: "config" or "forward").
LAYOUTS = {
    "ratios_short": (dict(compress_ratios=h.A["compress_ratios"][:9]),
                     "compress_ratios has 9 entries for 10 layers",
                     "compress_ratios must cover every active backbone layer", "config"),
    "ratio_negative": (dict(compress_ratios=h.A["compress_ratios"][:10] + [0, -1, 0]),
                       r"compress_ratios\[11\] = -1", "non-negative integers", "config"),
    "ids_not_increasing": (dict(kv_source_layer_ids=[4, 2, 6]),
                           r"kv_source_layer_ids \[4, 2, 6\] must be strictly increasing",
                           "strictly increasing", "config"),
    "ids_past_the_ratios": (dict(engram_layer_ids=[1, 13]),
                            "engram_layer_ids has layer 13",
                            "must refer to layers covered by compress_ratios", "config"),
    "kv_source_not_indexed": (dict(index_source_layer_ids=[2, 6, 8]),
                              "KV source layer 4 is not in index_source_layer_ids",
                              "Every KV source must also occur", "config"),
    "swa_source": (dict(kv_source_layer_ids=[0, 2, 4, 6],
                        index_source_layer_ids=[0, 2, 4, 6, 8]),
                   "SWA layer 0 cannot be a KV or index source", "SWA-only layer 0", "config"),
    "ratio_without_source": (dict(kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 8],
                                  candidate_source_layer_id=-1),
                             r"compressed layer 6 \(ratio 1\) needs an earlier KV source",
                             "Compressed layer 6 needs a preceding KV source", "config"),
    "candidate_not_a_source": (dict(candidate_source_layer_id=8),
                               "candidate_source_layer_id 8 must be a KV source",
                               "must identify a Full-mode KV source", "config"),
    "candidate_id_negative": (dict(candidate_source_layer_id=-2),
                              "candidate_source_layer_id must be -1", "must be -1", "config"),
    "engram_rows": (dict(engram_num_embeddings=[600]),
                    "engram_num_embeddings needs one row count per",
                    "one table row count per engram_layer_ids entry", "config"),
    "engram_rows_zero": (dict(engram_num_embeddings=[600, 0]),
                         "engram_num_embeddings has 0", "positive integer row counts",
                         "config"),
    # The case: config B's ratio-2 stack with the candidate source at layer 1 and a
    # second KV source (full context, same ratio) at 3. The reference's config takes it; its
    # forward refuses (layer 3's indexer finds no candidates). wideserve took it.
    "kv_source_after_candidates": (dict(h.B, kv_source_layer_ids=[1, 3],
                                        index_source_layer_ids=[1, 3],
                                        candidate_source_layer_id=1, candidate_topk_blocks=2,
                                        candidate_block_size=2),
                                   "KV source layer 3 comes after the candidate source 1",
                                   "requires candidates from its source layer", "forward"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_the_reference_refuses_are_refused_at_load(name):
    from nemo_automodel.components.models.deepseek_v41.config import \
        DeepseekV41Config as OracleConfig

    from wideserve.models.deepseek_v41.config import DeepseekV41Config
    changes, ours, theirs, where = LAYOUTS[name]
    kw = dict(h.A, **changes)
    with pytest.raises(ValueError, match=theirs):
        if where == "config":
            OracleConfig(text_config=dict(kw), vision_config={"num_hidden_layers": 0})
        else:
            h.oracle_logits(h.oracle_model(kw), h.random_tokens(16, seed=1))
    with pytest.raises(ValueError, match=f"DeepSeek-V4.1 config: {ours}"):
        DeepseekV41Config.from_dict({"text_config": kw})
    for base in h.CONFIGS.values():      # the tested layouts themselves stay accepted
        DeepseekV41Config.from_dict({"text_config": dict(base)})
