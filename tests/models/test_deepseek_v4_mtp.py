"""The MTP block (docs/deepseek_v4.md, "MTP"). HF does not build it, so the oracle is assembled
from HF's own parts: its decoder layer (a sliding-window / top-k MoE layer), RMSNorm, HyperHead
and rotary, fed with the HF main model's last-layer streams. wideserve runs it over the paged
harness (its own window cache, poison on) one-shot and as chunked prefill + decode."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import v4_configs as cfgs
from paged_harness import PagedHarness
from v4_helpers import hf_logits, hf_model, random_tokens, randomize_, ws_model

TOL = 1e-4
CASES = {"A": (30, [7, 5]), "C": (16, [3, 4])}    # length, prefill chunks (then decode)


def _hf_mtp_logits(hf, ws, kw: dict, seq: list[int]) -> torch.Tensor:
    """MTP logits for positions 0..L-2 (input token p, next token p+1), from HF parts."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    cfg = HFConfig(**{**kw, "num_hidden_layers": 1, "layer_types": [cfgs.SWA],
                      "mlp_layer_types": ["moe"]})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = hf.config._experts_implementation
    block = M.DeepseekV4DecoderLayer(cfg, 0).eval()
    head = M.DeepseekV4HyperHead(cfg)
    norms = {n: M.DeepseekV4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
             for n in ("enorm", "hnorm", "norm")}
    mtp = {k[len("mtp.0."):]: v for k, v in ws.state_dict().items() if k.startswith("mtp.0.")}
    block.load_state_dict({k: v for k, v in mtp.items() if k.split(".")[0] in {
        "self_attn", "mlp", "attn_hc", "ffn_hc", "input_layernorm", "post_attention_layernorm"}})
    head.load_state_dict({k[len("hc_head."):]: v for k, v in mtp.items()
                          if k.startswith("hc_head.")})
    for n, norm in norms.items():
        norm.weight.data.copy_(mtp[f"{n}.weight"])

    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.setdefault("streams", out))
    try:
        hf_logits(hf, seq[:-1])
    finally:
        hook.remove()
    streams = captured["streams"]                                         # [1, S, n, d]
    S = streams.shape[1]
    with torch.no_grad():
        e = hf.model.embed_tokens(torch.tensor([seq[1:]]))
        x = (F.linear(norms["hnorm"](streams), mtp["h_proj.weight"])
             + F.linear(norms["enorm"](e), mtp["e_proj.weight"]).unsqueeze(2))
        pos = torch.arange(S)[None]
        rope = M.DeepseekV4RotaryEmbedding(cfg)
        emb = {t: rope(x, pos, layer_type=t) for t in ("main", "compress")}
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        allowed = (j <= i) & (j > i - cfg.sliding_window)
        mask = torch.zeros(1, 1, S, S).masked_fill(~allowed, float("-inf"))
        out = block(x, input_ids=None, position_embeddings=emb, position_ids=pos,
                    attention_mask=mask, past_key_values=None)
        return hf.lm_head(norms["norm"](head(out)))[0].float()


@pytest.fixture(scope="module", params=sorted(CASES))
def setup(request):
    name = request.param
    kw = getattr(cfgs, name)
    hf = hf_model(kw, seed=5)
    ws = ws_model(kw, hf, mtp_layers=1)
    randomize_(ws.mtp, seed=6)
    L, chunks = CASES[name]
    seq = random_tokens(L, kw["vocab_size"], seed=7)
    return name, hf, ws, seq, chunks, _hf_mtp_logits(hf, ws, kw, seq)


def _run(ws, seq: list[int], sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Main + MTP logits for positions 0..L-2 in steps of `sizes`, over one paged harness."""
    specs = {**ws.kv_cache_specs(), **ws.mtp_kv_cache_specs()}
    h = PagedHarness(ws, max_reqs=1, max_len=len(seq) + 4, specs=specs)
    main, draft, done = [], [], 0
    for n in sizes:
        nxt = torch.tensor(seq[done + 1:done + n + 1])

        def fn(batch, nxt=nxt):
            hidden = ws.forward(batch)
            assert ws.last_streams.shape == (batch.num_tokens, ws.config.hc_mult,
                                             ws.config.hidden_size)
            mtp_hidden = ws.mtp_forward(batch, ws.last_streams, nxt)
            return ws.compute_logits(hidden), ws.compute_logits(mtp_hidden)

        m, d = h.run([0], [seq[done:done + n]], fn)
        main.append(m)
        draft.append(d)
        done += n
    return torch.cat(main), torch.cat(draft)


def test_mtp_matches_hf_parts_oneshot_and_incremental(setup):
    name, hf, ws, seq, chunks, ref = setup
    L = len(seq)
    main, draft = _run(ws, seq, [L - 1])
    assert (main - hf_logits(hf, seq[:-1])).abs().max().item() <= TOL
    assert ref.std() > 0.3
    assert (draft - ref).abs().max().item() <= TOL
    sizes = chunks + [1] * (L - 1 - sum(chunks))
    _, draft_inc = _run(ws, seq, sizes)
    assert (draft_inc - ref).abs().max().item() <= TOL


def test_mtp_specs_names_and_counts(setup):
    _, _, ws, _, _, _ = setup
    specs, mtp_specs = ws.kv_cache_specs(), ws.mtp_kv_cache_specs()
    assert list(mtp_specs) == ["mtp.0.self_attn.window"]
    assert not any(n.startswith("mtp.") for n in specs)
    assert mtp_specs["mtp.0.self_attn.window"] == specs["model.layers.0.self_attn.window"]
    names = {n for n, _ in ws.named_parameters() if n.startswith("mtp.0.")}
    for n in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
              "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head.hc_fn",
              "mtp.0.hc_head.hc_base", "mtp.0.hc_head.hc_scale", "mtp.0.attn_hc.fn",
              "mtp.0.ffn_hc.scale", "mtp.0.input_layernorm.weight",
              "mtp.0.self_attn.q_b_proj.weight", "mtp.0.mlp.gate.weight",
              "mtp.0.mlp.experts.gate_up_proj", "mtp.0.mlp.shared_experts.down_proj.weight"):
        assert n in names, n
    assert "mtp.0.mlp.gate.e_score_correction_bias" in ws.state_dict()
    assert not any("compressor" in n for n in names)
    no_mtp = ws_model(getattr(cfgs, setup[0]))
    assert ws.param_counts() == no_mtp.param_counts()
    total, active = ws.mtp_param_counts()
    assert total == sum(p.numel() for p in ws.mtp.parameters()) and 0 < active < total
    with pytest.raises(ValueError, match="MTP depth"):
        ws.mtp_forward(None, None, None, depth=1)
