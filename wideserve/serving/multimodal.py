"""Image inputs shared by every front end that takes them (docs/deepseek_v41.md, "Images"):
the OpenAI chat route, the Anthropic Messages route (both through serving/openai/images.py)
and the offline `LLM.generate` / `LLM.chat` (serving/llm.py).

All of them end in the same two steps, so an image gives the same tokens whichever way it
came in:
- `prepare_pil`: a PIL image preprocessed as the reference processor does
  (models/deepseek_v41/vision.py);
- `expand_pieces`: the prompt, cut at the placeholders (one per image) and each piece
  tokenised on its own (as the reference processor splits at the placeholder token), joined
  with each placeholder replaced by its image's span of `image_token_id` positions; the
  images become types/multimodal.py ImageInputs at their offsets.
Errors are ValueErrors naming the cause; the HTTP routes turn them into 400s.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
from wideserve.models.deepseek_v41.vision import PreparedImage, image_input, prepare_image
from wideserve.types.multimodal import IMAGE_PLACEHOLDER, ImageInput


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What a front end needs to take images: the model's placeholder id, its vision config
    (the preprocessing) and --limit-mm-per-prompt's image count."""
    token_id: int
    vision: DeepseekV41VisionConfig
    limit: int

    @classmethod
    def from_info(cls, info: Any, limit: int) -> ImageSupport | None:
        """From the engine's model info (a ModelInfo or its dict); None for a model that
        takes no images."""
        if dataclasses.is_dataclass(info):
            info = dataclasses.asdict(info)      # type: ignore[arg-type]
        if info.get("image_token_id") is None or not info.get("vision_config"):
            return None
        return cls(int(info["image_token_id"]),
                   DeepseekV41VisionConfig.from_dict(info["vision_config"]), limit)

    def check_count(self, n: int) -> None:
        if n > self.limit:
            raise ValueError(f"{n} images in the prompt; at most {self.limit} per prompt "
                             f"(--limit-mm-per-prompt image={self.limit})")


NO_IMAGES = ("this model takes no image inputs (it has no vision tower, or it runs with "
             "--limit-mm-per-prompt image=0)")


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:` URL; ValueError for anything else (a remote URL says
    that nothing here fetches URLs)."""
    if url.startswith(("http://", "https://")):
        raise ValueError("remote image URLs are not supported (this server does not fetch "
                         "URLs); send the image inline as a base64 data: URL")
    head, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ValueError("expected a base64 data: URL (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL is not valid base64") from None


def prepare_pil(image: Any, support: ImageSupport) -> PreparedImage:
    """A PIL image -> the tower's input; ValueError for anything else or an image that does
    not fit the model's image-token budget."""
    from PIL import Image
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    return prepare_image(image.convert("RGB"), support.vision)


def split_prompt(prompt: str, n_images: int) -> list[str]:
    """The prompt's text pieces around its placeholders; ValueError unless there is exactly
    one placeholder per image."""
    pieces = prompt.split(IMAGE_PLACEHOLDER)
    if len(pieces) != n_images + 1:
        raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholders "
                         f"({IMAGE_PLACEHOLDER!r}) for {n_images} images: put one where each "
                         f"image goes")
    return pieces


def expand_pieces(encoded: Sequence[Sequence[int]], prepared: Sequence[PreparedImage],
                  token_id: int) -> tuple[list[int], list[ImageInput]]:
    """Token ids of the pieces (len(prepared) + 1 of them) joined by the images' spans, and
    the ImageInputs at their offsets."""
    assert len(encoded) == len(prepared) + 1
    ids: list[int] = list(encoded[0])
    images = []
    for image, text in zip(prepared, encoded[1:]):
        inp = image_input(image, len(ids))
        images.append(inp)
        ids += [token_id] * inp.length
        ids += text
    return ids, images


def split_token_ids(ids: Sequence[int], n_images: int, token_id: int) -> list[list[int]]:
    """A token prompt cut at its placeholders: one `token_id` per image (vLLM's token prompts
    carry the placeholder once; the span is expanded here); ValueError otherwise."""
    pieces: list[list[int]] = [[]]
    for t in ids:
        if t == token_id:
            pieces.append([])
        else:
            pieces[-1].append(int(t))
    if len(pieces) != n_images + 1:
        raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholder tokens "
                         f"({token_id}) for {n_images} images: put one where each image goes")
    return pieces


# ------------------------------------------------------------------ the offline API's shapes
def multi_modal_images(data: Any) -> list[Any]:
    """vLLM's `multi_modal_data` ({"image": a PIL image or a list of them}) -> the images;
    ValueError for another shape or modality."""
    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': PIL.Image}}, "
                         f"got {type(data).__name__}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data: {other} not supported; this model takes "
                         f"'image' only")
    images = data.get("image")
    return list(images) if isinstance(images, (list, tuple)) else [images]


def chat_message_images(message: Mapping[str, Any], index: int
                        ) -> tuple[dict[str, Any], list[Any]]:
    """An offline chat message whose content is a list of parts -> the message the chat
    template sees (the parts as one string, each image part as IMAGE_PLACEHOLDER, as the
    server renders them) and its images (PIL): `image_url` parts with a base64 data: URL,
    `image_pil` parts with a PIL image (vLLM's offline part)."""
    from wideserve.models.deepseek_v41.vision import decode_image
    content = message.get("content")
    if not isinstance(content, list) or not any(
            isinstance(p, Mapping) and p.get("type") in ("image_url", "image_pil")
            for p in content):
        return dict(message), []
    text, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        where = f"messages[{index}].content[{j}]"
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url", "") if isinstance(url, Mapping) else url
            try:
                images.append(decode_image(data_url_bytes(str(url))))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            text.append(IMAGE_PLACEHOLDER)
        elif kind == "image_pil":
            images.append(part.get("image_pil"))
            text.append(IMAGE_PLACEHOLDER)
        elif kind != "refusal":
            raise ValueError(f"{where}: part type {kind!r} is not supported with images "
                             f"(text, image_url, image_pil)")
    return {**message, "content": "".join(text)}, images
