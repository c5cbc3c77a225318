"""OpenAI `image_url` content parts -> preprocessed images (Kimi-K2.5 / K2.6), every refusal an APIError.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}

- `data:` URLs of an `image/*` type, base64: the decoded size is known from the text's length,
  so an image over --max-image-bytes is a 413 before anything is decoded; bad base64 or an
  unreadable image a 400.
- `http(s)` URLs: a 400 naming `--allow-image-urls` unless the server was started with it; then
  fetched with a deadline (--image-fetch-timeout) and at most --max-image-bytes read.
- `detail`: only "auto" (or absent): moesplit has one resolution policy (the processor's), so
  "low" / "high" are a 400 rather than ignored. Other keys of the part are a 400 too.
- more than --max-images images in one request: a 400 naming it; pixels over --max-image-pixels
  (read from the header): a 413 (gpu_service.model.image_inputs).
Video and audio parts are refused by the caller (gpu_service.api.chat_request).
"""
from __future__ import annotations

import base64
import binascii
import re
import time
from dataclasses import dataclass

from gpu_service.api.errors import APIError
from gpu_service.model.image_inputs import ImageError, ImageInput, ImageLimits, load_image

_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?((?:;[\w-]+=[^;,]*)*)(;base64)?,", re.ASCII)
# the text K2.5's chat template writes for one image; its one <|media_pad|> becomes the image's tokens
IMAGE_MARKER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


@dataclass(frozen=True)
class ImagePolicy:
    """What this server takes: the limits, and whether http(s) URLs are fetched."""

    limits: ImageLimits = ImageLimits()
    allow_urls: bool = False
    fetch_timeout_s: float = 10.0


def image_of_part(part: dict, where: str, policy: ImagePolicy) -> ImageInput:
    """The ImageInput of one `image_url` part (module docstring); APIError naming `where` otherwise."""
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise APIError(400, f"{where}: unknown field(s) {extra} in an image_url part", param=where)
    spec = part.get("image_url")
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise APIError(400, f"{where}.image_url must be an object with a 'url' string", param=f"{where}.image_url")
    bad = sorted(set(spec) - {"url", "detail"})
    if bad:
        raise APIError(400, f"{where}.image_url: unknown field(s) {bad}; it takes 'url' and 'detail'",
                       param=f"{where}.image_url")
    if spec.get("detail", "auto") not in ("auto", None):
        raise APIError(400, f"{where}.image_url.detail {spec['detail']!r}: only 'auto' is served (one resolution "
                            "policy: at most 16384 patches of 14 px); leave it out", param=f"{where}.image_url.detail")
    url = spec["url"]
    lim = policy.limits
    if url.startswith("data:"):
        data = _data_url_bytes(url, where, lim)
    elif url.startswith(("http://", "https://")):
        if not policy.allow_urls:
            raise APIError(400, f"{where}: http(s) image URLs are not fetched by this server; send the image as a "
                                "data: URL (base64), or start the server with --allow-image-urls",
                           param=f"{where}.image_url.url")
        data = fetch(url, where, lim.max_bytes, policy.fetch_timeout_s)
    else:
        raise APIError(400, f"{where}.image_url.url must be a data: URL (or http(s) with --allow-image-urls), "
                            f"got {url[:32]!r}", param=f"{where}.image_url.url")
    try:
        return load_image(data, lim)
    except ImageError as e:
        raise APIError(e.status, f"{where}: {e}", param=f"{where}.image_url.url",
                       code="image_too_large" if e.status == 413 else "invalid_image") from None


def _data_url_bytes(url: str, where: str, lim: ImageLimits) -> bytes:
    """The bytes of a base64 `data:image/...` URL, its size checked before decoding."""
    m = _DATA_URL.match(url)
    if m is None or m.group(1) is None or m.group(3) is None:
        raise APIError(400, f"{where}.image_url.url: a data URL must read 'data:image/<type>;base64,<data>'",
                       param=f"{where}.image_url.url")
    payload = url[m.end():]
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > lim.max_bytes:
        raise APIError(413, f"{where}: image of {size} bytes; at most {lim.max_bytes} (--max-image-bytes)",
                       param=f"{where}.image_url.url", code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}.image_url.url: the data URL is not valid base64 ({e})",
                       param=f"{where}.image_url.url", code="invalid_image") from None


def fetch(url: str, where: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET `url`: at most max_bytes read, within timeout_s in all (413 / 400 naming the limit)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "moesplit"}),
                                    timeout=timeout_s) as r:
            declared = r.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise APIError(413, f"{where}: the image at the URL has {declared} bytes; at most {max_bytes} "
                                    "(--max-image-bytes)", param=f"{where}.image_url.url", code="image_too_large")
            buf = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise APIError(400, f"{where}: fetching the image took over {timeout_s:g} s "
                                        "(--image-fetch-timeout)", param=f"{where}.image_url.url")
                chunk = r.read(65536)
                if not chunk:
                    return bytes(buf)
                buf += chunk
                if len(buf) > max_bytes:
                    raise APIError(413, f"{where}: the image at the URL is over {max_bytes} bytes "
                                        "(--max-image-bytes)", param=f"{where}.image_url.url", code="image_too_large")
    except APIError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise APIError(400, f"{where}: could not fetch the image URL ({type(e).__name__}: {e})",
                       param=f"{where}.image_url.url") from None


def expand_placeholders(ids: list[int], pad_id: int, images: list[ImageInput]) -> list[int]:
    """The rendered prompt's ids with the k-th `<|media_pad|>` repeated images[k].tokens times; a
    400 when the prompt does not hold exactly one per image (e.g. typed into a message's text)."""
    at = [i for i, t in enumerate(ids) if t == pad_id]
    if len(at) != len(images):
        raise APIError(400, f"the rendered prompt holds {len(at)} image placeholder(s) for {len(images)} image(s): "
                            "a message's text may not contain <|media_pad|>", param="messages")
    out, prev = [], 0
    for i, img in zip(at, images):
        out += ids[prev:i] + [pad_id] * img.tokens
        prev = i + 1
    return out + ids[prev:]
