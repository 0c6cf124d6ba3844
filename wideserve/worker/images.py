"""Image rows of a step: the vision tower run once per request, its span embeddings handed to
the model for each chunk's rows (docs/deepseek_v41.md, "Images").

A request's images (types/multimodal.py) are encoded at the first step that reaches one of
their rows (CausalLM.embed_image: the ViT, the aligner and the delimiters), kept until a step
passes the last image row, and handed to the model as `IMAGE_ROWS` / `IMAGE_EMBEDS` in the
step's ForwardBatch.extras. A span split across prefill chunks takes its rows chunk by chunk;
a prefix-cache hit that ends inside a span starts from the first uncached row. A request that
is preempted keeps its embeddings; one that must recompute after they were dropped (its
prefill was done) runs the tower again at the step that reaches the span.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from wideserve.models.deepseek_v41.model import IMAGE_EMBEDS, IMAGE_ROWS
from wideserve.utils.device import to_device

if TYPE_CHECKING:
    from wideserve.models.interface import CausalLM
    from wideserve.types.request import Request

StepImages = tuple[np.ndarray, torch.Tensor]     # (rows within the step's tokens, embeddings)


class ImageEmbeddings:
    """Per request: (prompt positions of its image rows, their embeddings [K, d])."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._kept: dict[str, StepImages] = {}
        self.encoded = 0                     # images run through the tower (stats, tests)

    def for_step(self, request: Request, start: int, end: int) -> StepImages | None:
        """The rows of positions [start, end) that belong to an image span (relative to
        start) and their embeddings; None when the step holds no image row."""
        images = request.images
        if not images or start >= images[-1].end or end <= images[0].offset:
            return None
        rid = request.request_id
        kept = self._kept.get(rid)
        if kept is None:
            positions = np.concatenate([np.arange(im.offset, im.end) for im in images])
            with torch.inference_mode():
                embeds = torch.cat([self.model.embed_image(im) for im in images])
            self.encoded += len(images)
            kept = self._kept[rid] = (positions, embeds)
        positions, embeds = kept
        lo, hi = np.searchsorted(positions, [start, end])
        if end >= images[-1].end:            # past the last image row: not needed again
            del self._kept[rid]
        if lo == hi:
            return None
        return positions[lo:hi] - start, embeds[lo:hi]

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._kept.pop(rid, None)

    def __len__(self) -> int:
        return len(self._kept)


def image_extras(parts: Sequence[StepImages | None], query_start: np.ndarray,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The step's IMAGE_ROWS / IMAGE_EMBEDS from each request's share (None: no image row)
    and the requests' first rows in the flat batch."""
    rows, embeds = [], []
    for i, part in enumerate(parts):
        if part is not None:
            rows.append(part[0] + query_start[i])
            embeds.append(part[1])
    if not rows:
        return {}
    return {IMAGE_ROWS: to_device(np.concatenate(rows).astype(np.int64), device),
            IMAGE_EMBEDS: torch.cat(embeds).to(device)}
