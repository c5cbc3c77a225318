"""Kimi-K2.5's vision side: the MoonViT tower + projector (gpu_service.model.vision) against
transformers' Kimi_K25Model.get_image_features on the tiny checkpoint's own vision weights, the
image preprocessing (gpu_service.model.image_inputs) against transformers' Kimi_K25ImageProcessor,
and the image limits."""
import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gpu_service.model.image_inputs import ImageError, ImageLimits, load_image, navit_size, preprocess, token_count
from tests.wheels import unpacked_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def png(h: int, w: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """A random PNG of h x w pixels."""
    from PIL import Image

    a = np.random.default_rng(seed).integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).convert(mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("k25v") / "k25"), arch="kimi_k25", seed=4)


@pytest.fixture(scope="module")
def tower(tiny):
    from checkpoint.reader import CheckpointReader
    from gpu_service.model.vision import build_vision

    r = CheckpointReader(tiny)
    mm = r.config.multimodal
    return build_vision(mm["vision_config"], r.config.hidden_size,
                        lambda n: np.asarray(r.get_raw(n), dtype=np.float32), torch.device("cpu"), torch.float32)


def test_tower_equals_transformers_for_two_image_sizes(tiny, tower):
    """Both sizes differ from the 4x4 position table (bicubic resampling) and from each other."""
    from tests.hf_reference import load_reference_kimi_k25

    hf = load_reference_kimi_k25(tiny)
    for h, w, seed in ((60, 90, 1), (200, 130, 2), (56, 56, 3)):
        img = load_image(png(h, w, seed))
        got = tower.embed(img.patches, img.grid_h, img.grid_w)
        with torch.no_grad():
            ref = hf.model.get_image_features(img.patches, torch.tensor([[1, img.grid_h, img.grid_w]])).pooler_output
        assert len(ref) == 1 and got.shape == ref[0].shape == (img.tokens, 96)
        diff = (got - ref[0]).abs().max().item()
        print(f"{h}x{w} -> grid {img.grid_h}x{img.grid_w}, {img.tokens} tokens: max|diff| {diff:.2e}")
        assert ref[0].abs().max() > 0.1 and diff < 1e-5


TORCHVISION = "0.28.0"  # the torchvision release built against torch 2.13 (the CPU torch of the venv)

_REF_SCRIPT = r"""
import io, json, sys, types
try:
    import torchvision  # noqa: F401
except ImportError as e:
    if "torchvision" in str(e) and "No module" in str(e):
        print("NO_TORCHVISION"); sys.exit(0)
    raise
except RuntimeError:  # a CUDA torchvision wheel beside a CPU torch: its compiled ops are missing
    for m in [m for m in sys.modules if m.startswith("torchvision")]:
        del sys.modules[m]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
from PIL import Image
from transformers import Kimi_K25ImageProcessor
import numpy as np
p = Kimi_K25ImageProcessor()
out = {}
for path in sys.argv[1:]:
    r = p(images=[Image.open(path)], return_tensors="np")
    np.save(path + ".npy", r["pixel_values"])
    out[path] = r["image_grid_thw"].tolist()[0]
print(json.dumps(out))
"""


def test_preprocessing_equals_transformers_processor(tmp_path):
    """transformers' processor needs torchvision: run in a subprocess with PyPI's torchvision wheel
    unpacked on its path (tests/wheels.py; MOESPLIT_TORCHVISION_PATH overrides), as installing that
    CUDA build beside the CPU torch would break transformers' imports. Fails if it cannot be had."""
    import json

    cases = {"rgb": png(60, 90, 1), "rgba": png(45, 30, 2, "RGBA"), "tall": png(1000, 37, 3),
             "big": png(2400, 1800, 4), "gray": png(10, 10, 5, "L"), "palette": png(500, 700, 6, "P")}
    paths = []
    for k, data in cases.items():
        p = tmp_path / f"{k}.png"
        p.write_bytes(data)
        paths.append(str(p))
    env = dict(os.environ)
    extra = os.environ.get("MOESPLIT_TORCHVISION_PATH") or str(unpacked_wheel("torchvision", TORCHVISION))
    env["PYTHONPATH"] = extra + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _REF_SCRIPT, *paths], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NO_TORCHVISION" not in r.stdout, f"torchvision not importable from {extra}"
    grids = json.loads(r.stdout.strip().splitlines()[-1])
    for path, data in zip(paths, cases.values()):
        img = load_image(data, ImageLimits(max_bytes=len(data)))
        ref = np.load(path + ".npy")
        assert grids[path] == [1, img.grid_h, img.grid_w]
        np.testing.assert_array_equal(img.patches.numpy(), ref)  # bit-exact
        assert token_count(*__import__("PIL.Image", fromlist=["Image"]).open(path).size[::-1]) == img.tokens


def test_navit_size_caps_patches_and_sides():
    (nh, nw), (ph, pw) = navit_size(3000, 2000)
    assert (nh // 14) * (nw // 14) <= 16384 and ph % 28 == 0 and pw % 28 == 0 and ph >= nh and pw >= nw
    assert navit_size(100, 100) == ((100, 100), (112, 112))  # never upscaled, padded to 28
    (nh, nw), _ = navit_size(20000, 10)
    assert nh <= 512 * 14 and nw >= 1
    rgb = np.zeros((100, 100, 3), np.uint8)
    patches, gh, gw = preprocess(rgb)
    assert (gh, gw) == (8, 8) and patches.shape == (64, 3, 14, 14)
    assert patches[-1].min() == -1.0  # the zero padding, normalised


def test_limits_and_corrupt_images():
    data = png(64, 64)
    with pytest.raises(ImageError) as e:
        load_image(data, ImageLimits(max_bytes=len(data) - 1))
    assert e.value.status == 413 and "--max-image-bytes" in str(e.value)
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (20000, 20000)).save(buf, "PNG")  # 400 Mpixel, small file: refused from the header
    t0 = time.perf_counter()
    with pytest.raises(ImageError) as e:
        load_image(buf.getvalue())
    assert e.value.status == 413 and "--max-image-pixels" in str(e.value) and time.perf_counter() - t0 < 0.5
    for bad in (b"not an image", data[:100], b""):
        with pytest.raises(ImageError) as e:
            load_image(bad)
        assert e.value.status == 400 and "not a readable image" in str(e.value)
