"""make-tiny on a bare CUDA host (what `make gpu-check` meets: torch, numpy, no transformers,
safetensors or tokenizers): the gpu checks' checkpoints are still written, by torch alone, in the
safetensors format the reader takes, with the oracle's names, shapes and weight scales."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from checkpoint.reader import CheckpointReader
from gpu_service.local import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hand_written_safetensors_read_back_by_safetensors(tmp_path):
    from safetensors import safe_open

    ts = {"a.weight": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
          "c": (torch.randn(4, 4) * 10).to(torch.float8_e4m3fn), "d": torch.arange(6, dtype=torch.int32).view(2, 3),
          "s": torch.tensor(2.5)}
    path = str(tmp_path / "x.safetensors")
    tiny._write_safetensors(ts, path, {"format": "pt"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(ts)
        for k, t in ts.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else got,
                               t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_torch_init_checkpoint_loads_and_generates(tmp_path, fmt):
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    d = tiny.make_tiny(str(tmp_path / fmt), fmt=fmt, seed=3, init="torch")
    reader = CheckpointReader(d)
    t = {n: torch.from_numpy(reader.get(n)) for n in ("model.layers.0.input_layernorm.weight",
                                                      "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")}
    assert abs(t["model.layers.0.input_layernorm.weight"].mean().item() - 1.0) < 0.1  # norms near 1
    assert 0.05 < t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].std().item() < 0.2  # std ~0.1
    _, backend, _ = load_shard(d, None, None, "numpy")
    r = ModelRunner(reader, LocalExperts(backend), device=torch.device("cpu"), dtype=torch.float32, kv_tokens=256)
    res = r.generate([0, 5, 9, 13], 4)
    assert len(res.token_ids) == 4 and torch.isfinite(res.last_logits).all()
    again = tiny.make_tiny(str(tmp_path / "again"), fmt=fmt, seed=3, init="torch")
    assert torch.equal(torch.from_numpy(CheckpointReader(again).get("model.embed_tokens.weight")),
                       torch.from_numpy(reader.get("model.embed_tokens.weight"))), "seeded: the same weights"


def test_make_tiny_without_transformers_safetensors_tokenizers(tmp_path):
    code = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("transformers", "safetensors", "tokenizers"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Refuse())
import importlib.util
importlib.util.find_spec = (lambda f: lambda name, *a: None if name.split(".")[0] in
                            ("transformers", "safetensors", "tokenizers") else f(name, *a))(importlib.util.find_spec)
from gpu_service.local.tiny import make_tiny
from checkpoint.reader import CheckpointReader
from checkpoint.names import expected_shapes
d = make_tiny({str(tmp_path / "bare")!r}, fmt="fp8", seed=1, arch="deepseek_v32", overrides={{"num_hidden_layers": 3}})
r = CheckpointReader(d)
assert r.verify(list(expected_shapes(r.config))) > 0
assert "transformers" not in sys.modules and "safetensors" not in sys.modules
print("OK")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
    assert "transformers does not import here" in p.stderr and "has no tokenizer" in p.stderr
    reader = CheckpointReader(str(tmp_path / "bare"))
    from checkpoint.names import expected_shapes

    assert reader.verify(list(expected_shapes(reader.config))) > 0
    assert not os.path.exists(tmp_path / "bare" / "tokenizer.json")
