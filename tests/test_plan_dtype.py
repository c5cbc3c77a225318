"""The plan counts the compute dtype: `moesplit plan --dtype`, and generate/serve plan in
the dtype they will run; `--device cuda --dtype float32` with a plan that only fits in bf16 is
refused before CUDA is touched; preflight checks the device count first, subtracts only the
CUDA context and runs on the `--device cuda:N` given."""
from __future__ import annotations

import argparse

import pytest
import torch

from gpu_service import plan as P
from gpu_service.entrypoints import generate, plan_cli
from gpu_service.model import placement as PL

MODEL = "deepseek-v3.2"  # on 24 GiB: fits in bf16, not in fp32 (even with the KV cache at its minimum)


def _plan_cli(*argv):
    p = argparse.ArgumentParser()
    plan_cli.add_arguments(p)
    return plan_cli.run(p.parse_args(list(argv)))


def test_plan_dtype_float32_does_not_fit_where_bf16_does(capsys):
    assert _plan_cli("--model", MODEL, "--gpu", "24GiB") == 0
    capsys.readouterr()
    assert _plan_cli("--model", MODEL, "--gpu", "24GiB", "--dtype", "float32") == 3
    out = capsys.readouterr().out
    assert "dtype float32" in out and "missing" in out


def test_fp32_bytes_are_twice_the_bf16_items():
    cfg, _ = P.load_model_config("deepseek-v3")
    kw = dict(kv_tokens=4096, min_kv_tokens=4096, attention_weights="bf16", embeddings="gpu", gpu_experts=0,
              suggest=False)
    a, b = (P.make_plan(cfg, ["200GiB"], dtype=d, **kw).gpus[0].items for d in ("bfloat16", "float32"))
    for k in ("embeddings", "attention", "dense_mlp", "shared_experts", "lm_head", "kv_cache"):
        assert b[k] == 2 * a[k], k
    assert b["routers"] == a["routers"]  # f32 in both
    # (the workspace differs both ways: fp32 rows are twice as wide, but fp32 scores need no 16-bit twin)
    with pytest.raises(ValueError, match="dtype"):
        P.make_plan(cfg, ["24GiB"], dtype="float64")


class _Touched(AssertionError):
    pass


@pytest.fixture
def cuda_untouchable(monkeypatch):
    """CUDA looks present, but any query beyond is_available() fails the test."""
    def touched(*a, **k):
        raise _Touched("CUDA was touched before the plan refused")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("device_count", "mem_get_info", "get_device_properties", "init", "set_device"):
        monkeypatch.setattr(torch.cuda, name, touched)


def _generate_args(*argv):
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return p.parse_args(["--model", "unused", "--prompt-ids", "1,2"] + list(argv))


def test_generate_fp32_on_cuda_refused_before_cuda_is_touched(cuda_untouchable, capsys):
    cfg, _ = P.load_model_config(MODEL)
    args = _generate_args("--device", "cuda", "--dtype", "float32", "--gpu", "24GiB")
    with pytest.raises(SystemExit) as e:
        PL.placement_from_args(args, cfg, 4096, device=torch.device("cuda"))
    assert "does not fit in float32" in str(e.value) and "--dtype bfloat16" in str(e.value)
    # the same plan in bf16 fits, and only then is CUDA asked (device count first)
    args = _generate_args("--device", "cuda", "--dtype", "bfloat16", "--gpu", "24GiB")
    with pytest.raises(_Touched):
        PL.placement_from_args(args, cfg, 4096, device=torch.device("cuda"))


def _plan(n_gpus):
    cfg, _ = P.load_model_config("deepseek-v3")
    return P.make_plan(cfg, ["80GiB"] * n_gpus, kv_tokens=4096, min_kv_tokens=4096, suggest=False)


def test_preflight_checks_device_count_first(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (80 << 30, 80 << 30))
    with pytest.raises(PL.PlanDoesNotFit, match="uses 2 GPUs but 1 is visible"):
        PL.preflight(_plan(2))
    assert asked == []
    with pytest.raises(PL.PlanDoesNotFit, match="from cuda:1 but 1 is visible"):
        PL.plan_devices(_plan(1), torch.device("cuda", 1))


def test_preflight_subtracts_only_the_cuda_context_on_the_device_given(monkeypatch):
    plan = _plan(1)
    g = plan.gpus[0]
    asked = []
    free = {"bytes": g.used_bytes - P.CUDA_CONTEXT_BYTES}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (free["bytes"], 80 << 30))
    devices = PL.plan_devices(plan, torch.device("cuda", 1))
    assert devices == [torch.device("cuda", 1)]
    PL.preflight(plan, devices=devices)  # exactly enough: the fragmentation allowance is still needed
    assert asked == [torch.device("cuda", 1)]
    free["bytes"] -= 1 << 20
    with pytest.raises(PL.PlanDoesNotFit, match="GPU 1: 0.00 GiB missing"):
        PL.preflight(plan, devices=devices)
