"""`wideserve generate [MODEL] --prompt TEXT [sampling flags]`: one-off generation."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any

# Sampling flag -> SamplingParams field (the field is what a validation error names).
_SAMPLING_FLAGS: dict[str, str] = {
    "--max-tokens": "max_tokens", "--min-tokens": "min_tokens", "--temperature": "temperature",
    "--top-p": "top_p", "--top-k": "top_k", "--min-p": "min_p", "--sampling-seed": "seed",
    "--n": "n", "--logprobs": "logprobs", "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty", "--repetition-penalty": "repetition_penalty",
    "--stop": "stop", "--ignore-eos": "ignore_eos",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from wideserve.entrypoints.engine_args import add_engine_args, one_line_error
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description=__doc__.splitlines()[0])
    p.error = one_line_error.__get__(p)      # type: ignore[method-assign]
    add_engine_args(p)
    g = p.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several prompts)")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS may stop it")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest one's probability")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed for this request's sampling (reproducible outputs)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--logprobs", type=int, default=None,
                   help="return this many top log-probabilities per token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages repeating prompt and output tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    return p


def _sampling_params(args: argparse.Namespace):
    from wideserve.types.sampling_params import SamplingParams
    kwargs = {field: getattr(args, flag[2:].replace("-", "_"))
              for flag, field in _SAMPLING_FLAGS.items()}
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        field = re.match(r"(\w+)", str(exc))
        flag = next((f for f, name in _SAMPLING_FLAGS.items()
                     if field and name == field.group(1)), None)
        raise ValueError(f"{flag}: {exc}" if flag else str(exc)) from None


def run(args: argparse.Namespace) -> int:
    try:
        params = _sampling_params(args)
    except ValueError as exc:
        print(f"wideserve generate: error: {exc}", file=sys.stderr)
        return 2
    from wideserve.serving.llm import LLM
    from wideserve.entrypoints.engine_args import engine_config_from_args
    config = engine_config_from_args(args)
    try:
        llm = LLM.from_engine_config(config)
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                            use_tqdm=False)
        else:
            outs = llm.generate(args.prompt, params, use_tqdm=False)
    except (FileNotFoundError, ValueError) as exc:
        print(f"wideserve generate: error: {exc}", file=sys.stderr)
        return 1
    for prompt, out in zip(args.prompt, outs):
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{label}{prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, "
                  f"finish: {c.finish_reason})")
    return 0
