"""Chat image inputs (docs/deepseek_v41.md, "Images"): OpenAI `image_url` content parts.

Each part must be a base64 `data:` URL (the server fetches no URL: a remote http(s) one is a
400 saying so). The image is decoded with Pillow and preprocessed as the reference processor
does (models/deepseek_v41/vision.py); its placeholder in the rendered prompt
(protocol.IMAGE_PLACEHOLDER, one per part, where the part was) becomes the image's span of
image_token_id positions, and the patches travel to the engine as a types/multimodal.py
ImageInput. Every failure is the request's: a 400 naming `messages`.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
from wideserve.models.deepseek_v41.vision import (decode_image, image_input, prepare_image)
from wideserve.serving.openai.protocol import IMAGE_PLACEHOLDER, ChatMessage
from wideserve.serving.openai.serving import ApiError
from wideserve.types.multimodal import ImageInput

if TYPE_CHECKING:
    from wideserve.serving.openai.serving import ServingContext


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What the front end needs to take images: the model's placeholder id, its vision
    config (the preprocessing) and --limit-mm-per-prompt's image count."""
    token_id: int
    vision: DeepseekV41VisionConfig
    limit: int

    @classmethod
    def from_info(cls, info: dict[str, Any], limit: int) -> ImageSupport | None:
        """From the engine's model info; None for a model that takes no images."""
        if info.get("image_token_id") is None or not info.get("vision_config"):
            return None
        return cls(int(info["image_token_id"]),
                   DeepseekV41VisionConfig.from_dict(info["vision_config"]), limit)


def decode_data_url(url: str, index: int) -> bytes:
    """The bytes of a base64 `data:` URL; a 400 for anything else."""
    where = f"messages: image {index}"
    if url.startswith(("http://", "https://")):
        raise ApiError(400, f"{where}: remote image URLs are not supported (this server does "
                            f"not fetch URLs); send the image inline as a base64 data: URL",
                       param="messages")
    head, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ApiError(400, f"{where}: expected a base64 data: URL "
                            f"(data:image/png;base64,...)", param="messages")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the data: URL is not valid base64",
                       param="messages") from None


def prepare_chat_images(support: ImageSupport | None, messages: list[ChatMessage]
                        ) -> list[Any]:
    """The messages' images, decoded and preprocessed (PreparedImage), in prompt order;
    400s: no vision tower, over the limit, not a data: URL, not an image."""
    parts = [p for m in messages for p in m.images()]
    if not parts:
        return []
    if support is None:
        raise ApiError(400, "messages: this model takes no image inputs (it has no vision "
                            "tower, or the server runs with --limit-mm-per-prompt image=0)",
                       param="messages")
    if len(parts) > support.limit:
        raise ApiError(400, f"messages: {len(parts)} images in the prompt; at most "
                            f"{support.limit} per prompt (--limit-mm-per-prompt image="
                            f"{support.limit})", param="messages")
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
    (the text between placeholders tokenised piece by piece, as the reference processor
    splits at the placeholder token), and the ImageInputs at their offsets."""
    support = ctx.images
    assert support is not None
    pieces = prompt.split(IMAGE_PLACEHOLDER)
    if len(pieces) != len(prepared) + 1:
        raise ApiError(400, f"messages: the prompt holds {len(pieces) - 1} image placeholders "
                            f"for {len(prepared)} images (the chat template dropped an "
                            f"image, or the text contains {IMAGE_PLACEHOLDER!r})",
                       param="messages")
    encoded = [await ctx.encode(p, add_special_tokens and i == 0, "messages") if p else []
               for i, p in enumerate(pieces)]
    ids: list[int] = list(encoded[0])
    images = []
    for image, text in zip(prepared, encoded[1:]):
        inp = image_input(image, len(ids))
        images.append(inp)
        ids += [support.token_id] * inp.length
        ids += text
    return ids, images
