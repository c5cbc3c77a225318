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
