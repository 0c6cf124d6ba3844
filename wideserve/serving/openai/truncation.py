"""vLLM's `truncate_prompt_tokens`: keep only the last k tokens of a prompt (-1: as many as
the context holds), so a client can send a prompt longer than the context and have its start
dropped instead of a 400. Applied after tokenisation (and, for chat, after the template), as
vLLM applies it; a k beyond the context length is a 400, as in vLLM."""
from __future__ import annotations

from wideserve.serving.openai.serving import ApiError, ServingContext

# The most characters of prompt text tokenised whole before truncation (the body-size limit
# bounds it too): enough for any context this server runs, never a whole memory's worth.
_MAX_TRUNCATED_CHARS = 64 << 20


def resolve_keep(ctx: ServingContext, k: int | None) -> int | None:
    if k is None:
        return None
    if k == -1:
        return ctx.max_model_len
    if k > ctx.max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens: {k} exceeds this model's maximum "
                            f"context length of {ctx.max_model_len} tokens",
                       param="truncate_prompt_tokens")
    return k


async def encode_keep_last(ctx: ServingContext, texts: list[str], add_special_tokens: bool,
                           keep: int, param: str = "prompt") -> list[list[int]]:
    """Each text's ids, cut to its last `keep` tokens."""
    assert ctx.pool is not None
    if sum(map(len, texts)) > _MAX_TRUNCATED_CHARS:
        raise ApiError(400, f"{param}: more than {_MAX_TRUNCATED_CHARS} characters cannot be "
                            f"tokenised for truncation", param=param)
    out = []
    # Every token covers at least one character: this bound never cuts a count short.
    for ids in await ctx.pool.encode_many(texts, add_special_tokens,
                                          max_tokens=_MAX_TRUNCATED_CHARS + 2):
        assert not isinstance(ids, int)
        out.append(keep_last(ids, keep))
    return out


def keep_last(ids: list[int], keep: int | None) -> list[int]:
    if keep is None or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if keep > 0 else []
