"""Chat image inputs (docs/deepseek_v41.md, "Images"): OpenAI `image_url` content parts.

Each part must be a base64 `data:` URL (the server fetches no URL: a remote http(s) one is a
400 saying so). The image is decoded with Pillow and preprocessed as the reference processor
does (models/deepseek_v41/vision.py); its placeholder in the rendered prompt
(types/multimodal.py IMAGE_PLACEHOLDER, one per part, where the part was) becomes the image's
span of image_token_id positions (serving/multimodal.py, shared with the offline LLM), and
the patches travel to the engine as a types/multimodal.py ImageInput. Every failure is the
request's: a 400 naming `messages`. The Anthropic route's image blocks arrive here as
image_url parts (serving/anthropic/convert.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wideserve.models.deepseek_v41.vision import decode_image, prepare_image
from wideserve.serving.multimodal import (NO_IMAGES, ImageSupport, data_url_bytes,
                                          expand_pieces, split_prompt)
from wideserve.serving.openai.protocol import ChatMessage
from wideserve.serving.openai.serving import ApiError
from wideserve.types.multimodal import ImageInput

if TYPE_CHECKING:
    from wideserve.serving.openai.serving import ServingContext

__all__ = ["ImageSupport", "decode_data_url", "prepare_chat_images", "expand_images"]


def decode_data_url(url: str, index: int) -> bytes:
    """The bytes of a base64 `data:` URL; a 400 for anything else."""
    try:
        return data_url_bytes(url)
    except ValueError as e:
        raise ApiError(400, f"messages: image {index}: {e}", param="messages") from None


def prepare_chat_images(support: ImageSupport | None, messages: list[ChatMessage]
                        ) -> list[Any]:
    """The messages' images, decoded and preprocessed (PreparedImage), in prompt order;
    400s: no vision tower, over the limit, not a data: URL, not an image."""
    parts = [p for m in messages for p in m.images()]
    if not parts:
        return []
    if support is None:
        raise ApiError(400, f"messages: {NO_IMAGES}", param="messages")
    try:
        support.check_count(len(parts))
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    out = []
    for i, part in enumerate(parts):
        data = decode_data_url(part.image_url.url, i)
        try:
            out.append(prepare_image(decode_image(data), support.vision))
        except ValueError as e:
            raise ApiError(400, f"messages: image {i}: {e}", param="messages") from None
    return out


async def expand_images(ctx: ServingContext, prompt: str, prepared: list[Any],
                        add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
    """Token ids of the rendered prompt with each placeholder expanded to its image's span
    (serving/multimodal.py expand_pieces), and the ImageInputs at their offsets."""
    support = ctx.images
    assert support is not None
    try:
        pieces = split_prompt(prompt, len(prepared))
    except ValueError as e:
        raise ApiError(400, f"messages: {e} (the chat template dropped an image, or the text "
                            f"contains the placeholder)", param="messages") from None
    encoded = [await ctx.encode(p, add_special_tokens and i == 0, "messages") if p else []
               for i, p in enumerate(pieces)]
    return expand_pieces(encoded, prepared, support.token_id)
