"""Kimi-K2.5 images through the engine: greedy tokens equal transformers' Kimi_K25ForConditionalGeneration
(fp32) on the tiny checkpoint for one image and for two images of different sizes, 32 new tokens, 2 shard
processes on the default backend, chunked prefill whose chunks start and end inside images; the image
embedding cache and the prefix cache hit for the same image again; two different images with the same
text share no image pages."""
import io

import numpy as np
import pytest
import torch

from gpu_service.model.image_inputs import load_image

N_NEW = 32


def png(h: int, w: int, seed: int) -> bytes:
    """A smooth random PNG (a few gradients: not noise, so the image matters less than the text)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(np.sin(x / rng.uniform(3, 20) + rng.uniform(0, 6)) * 120 + 128 +
                   y * rng.uniform(-1, 1)) for _ in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


IMG_A, IMG_B, IMG_C = png(60, 90, 1), png(200, 130, 2), png(60, 90, 3)  # A and C: same size, different pixels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("k25i") / "k25"), arch="kimi_k25", seed=4)


def prompt(cfg, images) -> list[int]:
    """Text ids around `<|media_begin|> <pad>*n <|media_end|>` per image (ids of the tiny tokenizer)."""
    pad = cfg.multimodal["media_placeholder_token_id"]
    ids = [5 + i * 7 % 300 for i in range(11)]
    for k, img in enumerate(images):
        ids += [pad - 3] + [pad] * img.tokens + [pad - 1] + [70 + k, 9 + k, 150 + k]
    return ids


@pytest.fixture(scope="module")
def hf(tiny):
    from tests.hf_reference import load_reference_kimi_k25

    m = load_reference_kimi_k25(tiny)
    m.generation_config.eos_token_id = None
    return m


def reference(hf, ids, images) -> list[int]:
    """transformers' greedy continuation (fp32) of `ids` with the images' pixel values."""
    pv = torch.cat([img.patches for img in images])
    grid = torch.tensor([[1, img.grid_h, img.grid_w] for img in images])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pv, image_grid_thw=grid, max_new_tokens=N_NEW,
                          do_sample=False)
    ref = out[0, len(ids):].tolist()
    # transformers embeds a *generated* placeholder id as token 0 (its multimodal mask covers every
    # position), the engine as itself: a continuation holding it cannot be compared (the prompts avoid it)
    assert hf.config.image_token_id not in ref
    return ref


@pytest.fixture(scope="module")
def engine(tiny):
    """2 shard processes on the default backend, a float32 CPU runner, prefill chunks of 7 tokens."""
    from gpu_service.entrypoints.serving import build_runner
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.engine import Engine

    shards = start_shards(tiny, 2, split="experts", backend="auto")
    runner, client, tok = build_runner(tiny, shards.addresses, "cpu", "float32", kv_tokens=2048, page_size=16)
    eng = Engine(runner, tok, max_batch=4, chunk_tokens=7, check_pool=True).start()
    try:
        yield eng
    finally:
        eng.stop()
        client.close()
        shards.stop()


def run(engine, ids, images):
    """Greedy tokens and the handle (cached_tokens) of one request."""
    from gpu_service.runtime.sampling import SamplingParams

    h = engine.submit(ids, SamplingParams(temperature=0.0), max_tokens=N_NEW, ignore_eos=True, images=images)
    toks, _, finish = h.result(timeout=600)
    assert finish == "length", h.error
    return toks, h


def test_one_image_equals_transformers_and_hits_the_caches(engine, hf):
    a = load_image(IMG_A)
    ids = prompt(engine.cfg, [a])
    ref = reference(hf, ids, [a])
    got, h1 = run(engine, ids, [load_image(IMG_A)])
    assert len(ref) == N_NEW and got == ref
    s0 = engine.stats()
    again, h2 = run(engine, ids, [load_image(IMG_A)])  # a new ImageInput of the same bytes
    s1 = engine.stats()
    assert again == ref
    assert s1["image_hits"] == s0["image_hits"] + 1 and s1["image_misses"] == s0["image_misses"]
    assert h2.cached_tokens >= 16 * ((len(ids) - 1) // 16) > h1.cached_tokens  # every full page of the prompt
    print(f"one image ({a.tokens} tokens, prompt {len(ids)}): {got[:8]}...; second request cached "
          f"{h2.cached_tokens} tokens, image cache {s1['image_hits']} hits / {s1['image_misses']} misses")


def test_two_images_of_different_sizes_equal_transformers(engine, hf):
    a, b = load_image(IMG_A), load_image(IMG_B)
    assert (a.grid_h, a.grid_w) != (b.grid_h, b.grid_w)
    ids = prompt(engine.cfg, [a, b])
    ref = reference(hf, ids, [a, b])
    got, _ = run(engine, ids, [a, b])
    assert got == ref


def test_different_images_same_text_share_no_image_pages(engine, hf):
    a, c = load_image(IMG_A), load_image(IMG_C)
    assert a.tokens == c.tokens and a.digest != c.digest
    ids = prompt(engine.cfg, [c])
    assert ids == prompt(engine.cfg, [a])  # the same token ids: only the image differs
    run(engine, ids, [a])  # A's pages are cached
    got, h = run(engine, ids, [c])
    assert got == reference(hf, ids, [c])
    first_image_row = ids.index(engine.cfg.multimodal["media_placeholder_token_id"])
    assert h.cached_tokens <= first_image_row  # only pages before the image are shared


def test_placeholder_count_mismatch_is_refused(engine):
    from gpu_service.runtime.requests import RequestError

    a = load_image(IMG_A)
    ids = prompt(engine.cfg, [a])
    with pytest.raises(RequestError, match="placeholder"):
        engine.submit(ids[:-6] + ids[-4:], max_tokens=2, images=[a])  # two placeholders short
    with pytest.raises(RequestError, match="placeholder"):
        engine.submit(ids, max_tokens=2, images=[a, a])
