"""DeepSeek-V4.1's vision tower and the routing of images into the text sequence
(docs/deepseek_v41.md, "Images").

The released ViT (the reference's DeepseekV4VisionTransformer / DeepseekV4VisionAligner, names
as its state_dict under `model.`): patch embedding of normalised RGB patches, full bidirectional
attention over one image with a half-split 2D RoPE (rows in the first half of each rotary
pair's frequencies, columns in the second), a bias-free SwiGLU MLP, fp32 RMSNorms; the aligner
folds each ratio x ratio cell of patches (zero-padded at the right and bottom edges) into one
vector and projects it to the text width (w2(gelu(w1(.))))

An image occupies a span of prompt positions, all holding the checkpoint's `image_token_id`:
START, then per aligned row its cells followed by NEWLINE, then END. START / NEWLINE / END take
the learned `image_start` / `image_newline` / `image_end` vectors, the cells the aligner's
outputs. In the text model the rows given as image rows (not every `image_token_id`: the
reference marks spans) route their experts with the gate's `bias_vl` in place of the
score-correction bias, and Engram neither reads them in n-grams nor updates them (model.py).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wideserve.layers.moe import TopKRouter
from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
from wideserve.types.multimodal import ImageInput, image_digest

IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = range(4)
# The id an image row carries inside the text model (no token has it): set where the step's
# image embeddings replace the token embeddings (model.py, IMAGE_ROWS).
IMAGE_POSITION = -1


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True)
                                                + self.eps))).to(x.dtype)


def vision_rope(n_h: int, n_w: int, dim: int, theta: float, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, dim]: frequency j of a pair rotates by row (first half) or
    column (second half) position, fp32."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    rows = torch.arange(n_h, device=device)[:, None].expand(n_h, n_w)
    cols = torch.arange(n_w, device=device)[None, :].expand(n_h, n_w)
    freqs = (torch.stack([rows, cols], -1).reshape(-1, 2, 1).float() * inv).flatten(1)
    return freqs.cos()[:, None], freqs.sin()[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=True)
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [P, dim] (one image's patches; every patch sees every other) -> [P, dim]."""
        P = x.shape[0]
        q, k, v = (t.view(P, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, -1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(P, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, v: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(v.hidden_size)
        self.attn = VisionAttention(v.hidden_size, v.num_attention_heads)
        self.norm2 = VisionRMSNorm(v.hidden_size)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * v.patch_size ** 2, v.hidden_size, bias=True)


class VisionTransformer(nn.Module):
    """Names under `model.vision.`: patch_embed.proj, blocks.{i}.{norm1,attn,norm2,mlp}, norm."""

    def __init__(self, v: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.rope_dim = v.hidden_size // v.num_attention_heads // 2
        self.rope_theta = float(v.rope_theta)
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.num_hidden_layers))
        self.norm = VisionRMSNorm(v.hidden_size)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [n_h * n_w, 3, p, p] (row-major) -> [n_h * n_w, vision hidden]."""
        x = self.patch_embed.proj(patches.flatten(1))
        cos, sin = vision_rope(n_h, n_w, self.rope_dim, self.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class VisionAligner(nn.Module):
    """Names under `model.aligner.`: w1 [d, vision hidden * ratio^2], w2 [d, d] (biases)."""

    def __init__(self, v: DeepseekV41VisionConfig, hidden: int) -> None:
        super().__init__()
        self.ratio = v.downsample_ratio
        self.w1 = nn.Linear(v.hidden_size * self.ratio ** 2, hidden, bias=True)
        self.w2 = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[n_h * n_w, vision hidden] -> [ceil(n_h/r) * ceil(n_w/r), d] (cells row-major)."""
        r = self.ratio
        x = x.view(n_h, n_w, -1).permute(2, 0, 1)
        x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
        x = F.unfold(x[None], r, stride=r)[0].transpose(0, 1)
        return self.w2(F.gelu(self.w1(x)))


class VisionRouter(TopKRouter):
    """The V4.1 gate of a model with images: image rows (id IMAGE_POSITION) select their
    experts with `bias_vl` in place of `e_score_correction_bias` (selection only; the weights
    are the scores of the picks, as for text)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("bias_vl", torch.zeros(self.weight.shape[0], dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(x)
        image = (input_ids == IMAGE_POSITION)[:, None]
        bias = torch.where(image, self.bias_vl, self.e_score_correction_bias)
        return self.finish(s, torch.topk(s + bias, self.top_k, dim=-1).indices)


def add_vision_tower(model: nn.Module, v: DeepseekV41VisionConfig, hidden: int) -> None:
    """Register the tower on the text model's module under the reference's names:
    `vision`, `aligner`, `image_start`, `image_end`, `image_newline`."""
    model.vision = VisionTransformer(v)
    model.aligner = VisionAligner(v, hidden)
    for name in ("image_start", "image_end", "image_newline"):
        model.register_parameter(name, nn.Parameter(torch.empty(hidden)))


@torch.no_grad()
def span_embeddings(model: nn.Module, image: PreparedImage) -> torch.Tensor:
    """The embeddings of one image's whole span [grid.span_length, d] in the dtype of the
    text model's delimiters (`model` carries the tower of add_vision_tower)."""
    g = image.grid
    dtype = model.image_start.dtype
    w = model.vision.patch_embed.proj.weight
    cells = model.aligner(model.vision(image.patches.to(w.device, w.dtype), g.vit_height,
                                       g.vit_width), g.vit_height, g.vit_width).to(dtype)
    newline = model.image_newline.to(dtype).expand(g.llm_height, 1, -1)
    body = torch.cat([cells.view(g.llm_height, g.llm_width, -1), newline], dim=1).flatten(0, 1)
    return torch.cat([model.image_start.to(dtype)[None], body, model.image_end.to(dtype)[None]])


# ------------------------------------------------------------------ preprocessing
@dataclass(frozen=True, slots=True)
class ImageGrid:
    """The resized image (height, width in pixels), its ViT patch grid and its aligned
    (text-side) grid."""
    height: int
    width: int
    vit_height: int
    vit_width: int
    llm_height: int
    llm_width: int

    @property
    def span_length(self) -> int:
        """Prompt positions of the image: START, rows of cells + NEWLINE, END."""
        return self.llm_height * (self.llm_width + 1) + 2


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image ready for the tower: patches [vit_h * vit_w, 3, p, p] (bf16, as the
    reference's processor makes them) and its grid."""
    patches: torch.Tensor
    grid: ImageGrid


def plan_image_grid(width: int, height: int, v: DeepseekV41VisionConfig) -> ImageGrid:
    """The reference processor's resize plan: keep the aspect ratio, scale up to min_pixels,
    round to whole patches, and shrink to fit max_image_tokens positions."""
    if width <= 0 or height <= 0:
        raise ValueError("an image needs a positive width and height")
    lw: float = width
    lh: float = height
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        lw = height * v.max_wh_ratio
    if lw * lh < v.min_pixels:
        ratio = (v.min_pixels / (lw * lh)) ** 0.5
        lw, lh = int(lw * ratio), int(lh * ratio)
    p, r = v.patch_size, v.downsample_ratio
    bw, bh = math.ceil(lw / p) * p, math.ceil(lh / p) * p
    llm_h, llm_w = math.ceil(bh // p / r), math.ceil(bw // p / r)
    if llm_h * (llm_w + 1) + 2 > v.max_image_tokens:
        aspect = lh / lw
        max_w = math.sqrt((v.max_image_tokens - 2) / aspect + 0.25) - 0.5
        max_h = max_w * aspect
        cell = p * r
        if max_w < 1:
            bh, bw = (v.max_image_tokens - 2) // 2 * cell, cell
        elif max_h < 1:
            bh, bw = cell, (v.max_image_tokens - 3) * cell
        else:
            beta = min(math.floor(max_w) * cell / lw, math.floor(max_h) * cell / lh)
            bh = math.floor(lh * beta / p) * p
            bw = math.floor(lw * beta / p) * p
        llm_h, llm_w = math.ceil(bh // p / r), math.ceil(bw // p / r)
    if min(bh, bw) <= 0 or llm_h * (llm_w + 1) + 2 > v.max_image_tokens:
        raise ValueError("the image cannot fit in the model's image-token budget")
    return ImageGrid(bh, bw, bh // p, bw // p, llm_h, llm_w)


def decode_image(data: bytes):   # noqa: ANN201 - a PIL image; PIL is imported lazily
    """Encoded image bytes (PNG, JPEG, ...) -> an RGB PIL image; ValueError when they are not
    an image PIL reads, or one so large PIL refuses it as a decompression bomb (more than
    twice Image.MAX_IMAGE_PIXELS)."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image data cannot be decoded ({exc})") from exc


def prepare_image(image, v: DeepseekV41VisionConfig) -> PreparedImage:  # noqa: ANN001 - PIL
    """An RGB PIL image -> its patches, as the reference's processor: resize (very wide
    images) or pad with grey 127 to the planned size, scale to [-1, 1], round to bf16."""
    from PIL import ImageOps
    grid = plan_image_grid(image.width, image.height, v)
    if v.max_wh_ratio is not None and image.width >= v.max_wh_ratio * image.height:
        image = image.resize((grid.width, grid.height))
    else:
        image = ImageOps.pad(image, (grid.width, grid.height), color=(127, 127, 127))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    p = v.patch_size
    patches = (pixels.reshape(3, grid.vit_height, p, grid.vit_width, p).permute(1, 3, 0, 2, 4)
               .reshape(grid.vit_height * grid.vit_width, 3, p, p))
    return PreparedImage(patches, grid)


def image_input(image: PreparedImage, offset: int) -> ImageInput:
    """A prepared image as the engine takes it (types/multimodal.py), its span at `offset`."""
    g = image.grid
    grid = [g.height, g.width, g.vit_height, g.vit_width, g.llm_height, g.llm_width]
    patches = image.patches.contiguous().view(torch.int16).numpy().tobytes()
    return ImageInput(offset, g.span_length, grid, patches, image_digest(grid, patches))


def prepared_from_input(image: ImageInput) -> PreparedImage:
    """The engine's ImageInput back into the tower's input (patches bf16 [n, 3, p, p])."""
    grid = ImageGrid(*image.grid)
    n = grid.vit_height * grid.vit_width
    if image.length != grid.span_length or n == 0 or len(image.patches) % (6 * n):
        raise ValueError(f"an image's patches do not match its {grid.vit_height} x "
                         f"{grid.vit_width} grid")
    p = math.isqrt(len(image.patches) // (6 * n))
    raw = torch.frombuffer(bytearray(image.patches), dtype=torch.int16)
    return PreparedImage(raw.view(torch.bfloat16).view(n, 3, p, p), grid)
