"""Images as the Kimi-K2.5 vision tower takes them: decode, resize, pad, normalise, patch (no transformers).

The steps and numbers of transformers' `Kimi_K25ImageProcessor` (its defaults: at most 16384
patches of 14 px and 512 patches a side, 2x2 merge, mean = std = 0.5):
  1. decode with Pillow; RGB (transparency composited onto white, as transformers' convert_to_rgb);
  2. scale = min(1, sqrt(16384 / ((h // 14) * (w // 14))), 7168 / h, 7168 / w); new size
     int(h * scale) x int(w * scale) (at least 1); resized with the uint8 antialiased bicubic kernel
     torchvision uses for uint8 images on the CPU (torch's own `interpolate`; Pillow's bicubic
     differs from it by up to a few levels, so it is not used);
  3. zero-padded at the bottom / right to multiples of 28;
  4. (x - 127.5) / 127.5 in float32;
  5. 14x14 patches in row-major grid order, each [3, 14, 14].
An image becomes (H / 28) * (W / 28) `<|media_pad|>` tokens. Limits are checked before any pixel
is decoded (bytes) and from the header (pixels), so a decompression bomb is refused cheaply.
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from checkpoint.kimi_k25 import MAX_PATCHES, MAX_SIDE_PATCHES, MERGE, PATCH  # noqa: F401 (re-exported)


class ImageError(ValueError):
    """An image the server refuses; `status` 400 (unreadable) or 413 (over a limit); `limit` names it."""

    def __init__(self, message: str, status: int = 400, limit: str | None = None):
        super().__init__(message)
        self.status = status
        self.limit = limit


@dataclass(frozen=True)
class ImageLimits:
    """Per-request limits (the server's --max-images / --max-image-bytes / --max-image-pixels)."""

    max_images: int = 8
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 64 * 1024 * 1024  # decoded width * height, before the resize


@dataclass(eq=False)
class ImageInput:
    """One preprocessed image: `digest` (sha256 of the encoded bytes) keys the embedding cache and
    the prefix cache; `patches` [grid_h * grid_w, 3, 14, 14] float32; `tokens` placeholders."""

    digest: str
    patches: torch.Tensor
    grid_h: int
    grid_w: int

    @property
    def tokens(self) -> int:
        return (self.grid_h // MERGE) * (self.grid_w // MERGE)


def navit_size(height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) of an image (module docstring, step 2-3)."""
    ph, pw = max(1, height // PATCH), max(1, width // PATCH)
    scale = min(1.0, math.sqrt(MAX_PATCHES / (ph * pw)), MAX_SIDE_PATCHES * PATCH / height,
                MAX_SIDE_PATCHES * PATCH / width)
    nh = min(max(1, int(height * scale)), MAX_SIDE_PATCHES * PATCH)
    nw = min(max(1, int(width * scale)), MAX_SIDE_PATCHES * PATCH)
    f = MERGE * PATCH
    return (nh, nw), (-(-nh // f) * f, -(-nw // f) * f)


def token_count(height: int, width: int) -> int:
    """Placeholder tokens of an image of this decoded size."""
    _, (ph, pw) = navit_size(height, width)
    return (ph // (MERGE * PATCH)) * (pw // (MERGE * PATCH))


def decode_rgb(data: bytes, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """Encoded image bytes -> uint8 [H, W, 3]; ImageError naming the limit or the problem."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data)} bytes; at most {limits.max_bytes} (--max-image-bytes)", 413,
                         "max_image_bytes")
    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
        w, h = im.size
        if w * h > limits.max_pixels:
            raise ImageError(f"image of {w}x{h} pixels; at most {limits.max_pixels} pixels (--max-image-pixels)",
                             413, "max_image_pixels")
        im.load()
        if "A" in im.getbands() or im.info.get("transparency") is not None:
            im = im.convert("RGBA")
            im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im).convert("RGB")
        else:
            im = im.convert("RGB")
        return np.array(im)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own guard, past twice its MAX_IMAGE_PIXELS
        raise ImageError(f"image over {Image.MAX_IMAGE_PIXELS * 2} pixels ({e}); at most {limits.max_pixels} "
                         "pixels (--max-image-pixels)", 413, "max_image_pixels") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"not a readable image ({type(e).__name__}: {e}); send PNG, JPEG, WebP or GIF "
                         "bytes") from e


def preprocess(rgb: np.ndarray) -> tuple[torch.Tensor, int, int]:
    """uint8 [H, W, 3] -> (patches [gh * gw, 3, 14, 14] float32, gh, gw) (module docstring, steps 2-5)."""
    h, w = rgb.shape[:2]
    (nh, nw), (ph, pw) = navit_size(h, w)
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).contiguous()[None]  # [1, 3, H, W] uint8
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=[nh, nw], mode="bicubic", align_corners=False, antialias=True)
    x = F.pad(x, (0, pw - nw, 0, ph - nh))
    x = (x[0].to(torch.float32) - 127.5) / 127.5
    gh, gw = ph // PATCH, pw // PATCH
    patches = x.reshape(3, gh, PATCH, gw, PATCH).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, PATCH, PATCH)
    return patches.contiguous(), gh, gw


def load_image(data: bytes, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """Encoded bytes -> ImageInput (decoded, checked against `limits`, preprocessed)."""
    patches, gh, gw = preprocess(decode_rgb(data, limits))
    return ImageInput(hashlib.sha256(data).hexdigest(), patches, gh, gw)
