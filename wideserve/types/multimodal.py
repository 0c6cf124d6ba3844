"""An image input as it crosses into the engine (docs/deepseek_v41.md, "Images").

The server decodes and preprocesses the image (models/deepseek_v41/vision.py, the reference
processor's steps) and expands its placeholder in the prompt to the image's span: `length`
positions from `offset`, all holding the model's image_token_id. What travels to the engine
is the preprocessed patches (bf16 bytes, row-major [vit_h * vit_w, 3, p, p]), the grid and a
digest of the content; the worker runs the vision tower on them once per request, and the
prefix cache keys the blocks that hold the span by the digest (kv_cache/hashing.py), so two
prompts with the same text but different images never share KV.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

DIGEST_BYTES = 16
# Where an image sits in a rendered prompt (chat templates, LLM.generate's text prompts): the
# reference processor's placeholder, expanded to the image's span after tokenising.
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


@dataclass(slots=True)
class ImageInput:
    offset: int                 # prompt position of the span's first (START) row
    length: int                 # positions of the span (START, rows of cells + NEWLINE, END)
    # (height, width, vit_height, vit_width, llm_height, llm_width): the model's ImageGrid
    grid: list[int]
    patches: bytes              # bf16, [vit_height * vit_width, 3, p, p], row-major
    digest: bytes = b""         # of grid + patches (image_digest); filled by the maker

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_digest(grid: list[int], patches: bytes) -> bytes:
    """What the prefix cache keys an image by: the model sees only the patches and the grid."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(b",".join(str(int(g)).encode() for g in grid) + b";")
    h.update(patches)
    return h.digest()


def check_images(images: list[ImageInput], prompt_len: int) -> None:
    """ValueError unless the spans lie inside the prompt, in order, without overlap."""
    end = 0
    for im in images:
        if im.offset < end or im.length < 1 or im.end > prompt_len:
            raise ValueError(f"image span [{im.offset}, {im.end}) is out of order or outside "
                             f"the {prompt_len}-token prompt")
        if len(im.grid) != 6:
            raise ValueError("an image's grid has six entries")
        end = im.end
