"""DSpark drafter against the reference's DeepseekV41DSparkModel (nemo-automodel 0.7.0, fp32):
the same target features and anchors give the same draft logits (lm_head + Markov head) and
confidence logits, for anchors near the start (short context) and past the window."""
from __future__ import annotations

import pytest
import torch
import v41_helpers as h

from wideserve.models.deepseek_v41.config import DeepseekV41Config
from wideserve.models.deepseek_v41.common import place_weight
from wideserve.models.deepseek_v41.dspark import build_stages, draft_block, draft_head, dspark_rope

TOL = 1e-4


def load_stage_weights(targets: dict, weights) -> set[str]:   # noqa: ANN001
    """`mtp.*` tensors in the reference's naming into a bare stage module's `targets`, through
    the model's own placement (common.place_weight, which DeepseekV41ForCausalLM.load_weights
    uses for every tensor, DSpark's included); other names are skipped."""
    loaded: set[str] = set()
    parts: dict[str, int] = {}
    for raw, tensor in weights:
        if not raw.startswith("mtp.") or raw.endswith("bias_vl"):
            continue
        done = place_weight(targets, raw, raw, tensor, parts, "DSpark")
        if done is not None:
            loaded.add(done)
    return loaded


@pytest.fixture(scope="module")
def drafts():
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import \
        DeepseekV41Config as OracleConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import (
        DeepseekV41DSparkBackbone, DeepseekV41DSparkModel)
    kw = h.CONFIGS["A"]
    cfg = OracleConfig(text_config=dict(kw), vision_config={"num_hidden_layers": 0})
    be = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                       experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    torch.manual_seed(3)
    ref = DeepseekV41DSparkModel(cfg.text_config, be, num_anchors=2,
                                 enable_confidence_head=True).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("sinks_param.weight", ".base", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    S, B = 40, kw["dspark_block_size"]
    features = torch.randn(1, S, 3 * kw["hidden_size"], generator=g)
    tokens = torch.randint(3, h.VOCAB, (1, S + B), generator=g)
    anchors = torch.tensor([[5, 30]])
    labels = torch.stack([tokens[0, a + 1:a + 1 + B] for a in anchors[0].tolist()])   # [2, B]
    previous = torch.cat([tokens[0, anchors[0], None], labels[:, :-1]], dim=1)          # [2, B]
    noise = torch.full((2, B), kw["dspark_noise_token_id"])
    noise[:, 0] = tokens[0, anchors[0]]
    with torch.no_grad():
        out = DeepseekV41DSparkBackbone.forward(
            ref, ref.embed_tokens(noise.reshape(1, -1)), features,
            position_ids=ref.build_position_ids(anchors, S),
            attention_mask=ref.build_attention_mask(anchors, torch.ones_like(anchors, dtype=bool),
                                                    S, torch.float32),
            previous_token_ids=previous.reshape(1, -1))
        ref_logits = (ref.compute_logits(out.normalized_hidden_states)
                      + out.transition_logits.float()).view(2, B, -1)
    config = DeepseekV41Config.from_dict({"text_config": kw})
    ws = torch.nn.Module()          # the stages under `mtp.`, as the V4.1 model owns them
    ws.mtp = build_stages(config, dspark_rope(config))
    ws.config = config
    ws.eval()
    with torch.no_grad():
        loaded = load_stage_weights(ws.state_dict(keep_vars=True), ref.state_dict().items())
    assert loaded == {n for n in ws.state_dict() if not n.startswith("rope")}
    return dict(ref=ref, ws=ws, features=features, anchors=anchors[0], noise=noise,
                previous=previous, logits=ref_logits, conf=out.confidence_pred.view(2, B))


def test_draft_logits_and_confidence_equal_the_reference(drafts):
    d, ws = drafts, drafts["ws"]
    W = ws.config.sliding_window
    anchors = d["anchors"]
    ctx_pos = anchors[:, None] - W + torch.arange(W)                          # [2, W]
    valid = ctx_pos >= 0
    feats = d["features"][0][ctx_pos.clamp(min=0)]                            # [2, W, 3d]
    with torch.no_grad():
        states = draft_block(ws.mtp, ws.config, d["ref"].embed_tokens(d["noise"]), feats,
                             anchors, ctx_pos, valid)
        logits, conf = draft_head(ws.mtp, states, d["previous"], d["ref"].lm_head)
    assert d["logits"].std() > 0.3
    assert (logits - d["logits"]).abs().max().item() <= TOL
    assert (conf - d["conf"]).abs().max().item() <= TOL


def test_per_expert_stage_weights_load_into_their_slices(drafts):
    """The official checkpoint's one w1/w3/w2 per expert (what the loader hands over when it
    does not stack them) fill the same stacks as the reference's stacked tensors."""
    ws, ref = drafts["ws"], drafts["ref"]
    per_expert = []
    for name, t in ref.state_dict().items():
        p = name.removesuffix(".gate_and_up_projs")
        if p != name:                                   # [E, d, 2I] -> w1 / w3 [I, d] each
            half = t.shape[2] // 2
            for e in range(t.shape[0]):
                per_expert += [(f"{p}.{e}.w1.weight", t[e, :, :half].T.contiguous()),
                               (f"{p}.{e}.w3.weight", t[e, :, half:].T.contiguous())]
        elif name.endswith(".down_projs"):              # [E, I, d] -> w2 [d, I] each
            p = name.removesuffix(".down_projs")
            per_expert += [(f"{p}.{e}.w2.weight", t[e].T.contiguous()) for e in range(t.shape[0])]
        else:
            per_expert.append((name, t))
    assert any(n.endswith(".0.w1.weight") for n, _ in per_expert)
    fresh = torch.nn.Module()
    fresh.mtp = build_stages(ws.config, dspark_rope(ws.config))
    with torch.no_grad():
        loaded = load_stage_weights(fresh.state_dict(keep_vars=True), per_expert)
    assert loaded == {n for n in ws.state_dict() if not n.startswith("rope")}
    for name, t in ws.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
