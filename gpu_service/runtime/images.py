"""Images in a request's prompt: where their embeddings go, their cache, and their prefix-cache keys.

A request with images (Kimi-K2.5 / K2.6) carries `PromptImages`: the preprocessed images
(gpu_service.model.image_inputs.ImageInput) and, for each, the span of its `<|media_pad|>`
placeholder tokens in the prompt (the runs of the placeholder id, in order, each exactly the
image's token count, else RequestError). Prefill replaces the embeddings of the placeholder rows
of a chunk with the image's rows (`chunk_rows`): a chunk may start or end inside an image.

`ImageEmbeddings` computes an image's embeddings with the runner's vision tower once per content
digest (LRU cache, bounded in bytes). The prefix cache keys pages by token content; the
placeholder ids of two different images are the same, so `key_tokens` gives the prefix cache
the prompt with each placeholder replaced by a negative id drawn from the image digest and the
position in the image: equal only for the same image at the same place.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field

import torch

from gpu_service.plan.vision import EMBED_CACHE_BYTES
from gpu_service.runtime.requests import RequestError


@dataclass(eq=False)
class PromptImages:
    """The images of one prompt and their placeholder spans (start index, token count)."""

    images: list  # ImageInput
    spans: list[tuple[int, int]]
    embeds: list[torch.Tensor] | None = None  # [tokens, hidden] each, once computed
    _keys: list[int] | None = field(default=None, repr=False)

    def key_tokens(self, tokens: list[int]) -> list[int]:
        """`tokens` (prompt + generated) with the placeholders replaced by image-keyed ids."""
        if self._keys is None:
            keys = list(tokens[: self.spans[-1][0] + self.spans[-1][1]])
            for img, (s, n) in zip(self.images, self.spans):
                base = int.from_bytes(hashlib.sha256(img.digest.encode()).digest()[:7], "little")
                keys[s:s + n] = [-1 - ((base + j) & (2 ** 62 - 1)) for j in range(n)]
            self._keys = keys
        return self._keys + tokens[len(self._keys):]

    def chunk_rows(self, start: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
        """Rows of chunk [start, start + n) (0-based in the chunk) that are image tokens, and the
        embedding rows for them (slices of `embeds`, in row order)."""
        rows, vals = [], []
        for (s, m), e in zip(self.spans, self.embeds or []):
            lo, hi = max(s, start), min(s + m, start + n)
            if lo < hi:
                rows.extend(range(lo - start, hi - start))
                vals.append(e[lo - s:hi - s])
        return rows, vals


def find_spans(prompt_ids: list[int], pad_id: int, images: list) -> PromptImages:
    """PromptImages of `images` over the runs of `pad_id` in the prompt; RequestError when the
    runs and the images disagree (count or length)."""
    spans, i, n = [], 0, len(prompt_ids)
    while i < n:
        if prompt_ids[i] == pad_id:
            j = i
            while j < n and prompt_ids[j] == pad_id:
                j += 1
            spans.append((i, j - i))
            i = j
        else:
            i += 1
    if len(spans) != len(images) or any(m != img.tokens for (_, m), img in zip(spans, images)):
        raise RequestError(f"the prompt has {len(spans)} image placeholder run(s) of lengths {[m for _, m in spans]} "
                           f"but {len(images)} image(s) of {[img.tokens for img in images]} tokens were given: "
                           "each image needs exactly its count of placeholder tokens (the chat template writes "
                           "them)", "messages")
    return PromptImages(list(images), spans)


class ImageEmbeddings:
    """The vision tower's outputs per image digest, LRU-evicted past `max_bytes`; `stats` counts
    hits, misses and the images computed."""

    def __init__(self, tower, device: torch.device, dtype: torch.dtype, max_bytes: int = EMBED_CACHE_BYTES):
        self.tower, self.device, self.dtype, self.max_bytes = tower, device, dtype, int(max_bytes)
        self._lru: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = dict(hits=0, misses=0, cached_bytes=0, cached_images=0)

    def get(self, img) -> torch.Tensor:
        """[img.tokens, hidden] embeddings of `img` (computed on a miss)."""
        with self._lock:
            e = self._lru.get(img.digest)
            if e is not None:
                self._lru.move_to_end(img.digest)
                self.stats["hits"] += 1
                return e
        e = self.tower.embed(img.patches, img.grid_h, img.grid_w).to(self.dtype)
        with self._lock:
            self.stats["misses"] += 1
            if img.digest not in self._lru:
                self._lru[img.digest] = e
                self._bytes += e.numel() * e.element_size()
            while self._bytes > self.max_bytes and len(self._lru) > 1:
                _, old = self._lru.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
            self.stats["cached_bytes"], self.stats["cached_images"] = self._bytes, len(self._lru)
        return e

    def fill(self, pi: PromptImages) -> None:
        """Compute (or find) the embeddings of every image of a prompt, once."""
        if pi.embeds is None:
            pi.embeds = [self.get(img) for img in pi.images]


def prompt_images(runner, prompt_ids: list[int], images: list) -> PromptImages:
    """A request's images checked against the model and the prompt (RequestError naming the fix)."""
    if getattr(runner, "images", None) is None:
        raise RequestError("this model has no vision tower: send text only (images need a Kimi-K2.5 / K2.6 "
                           "checkpoint with its vision_tower.* / mm_projector.* tensors)", "messages")
    return find_spans(prompt_ids, int(runner.cfg.multimodal["media_placeholder_token_id"]), images)


def vision_embeddings(reader, device: torch.device, dtype: torch.dtype) -> ImageEmbeddings | None:
    """The image-embedding cache over the checkpoint's vision tower, or None for a text-only model
    (no `multimodal` config or no vision tensors)."""
    import numpy as np

    from gpu_service.model.vision import build_vision

    mm = getattr(reader.config, "multimodal", None)
    if not mm or not any(n.startswith("vision_tower.") for n in getattr(reader, "not_served", ())):
        return None
    tower = build_vision(mm["vision_config"], reader.config.hidden_size,
                         lambda n: np.asarray(reader.get_raw(n), dtype=np.float32), device, dtype)
    return ImageEmbeddings(tower, device, dtype)
