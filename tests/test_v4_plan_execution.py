"""The V4 runner executes a memory plan (gpu_service.model.placement.Placement.from_plan): on this
CPU-only machine each planned GPU is simulated by the CPU, as in tests/test_plan_execution.py; the
placement still decides which planned device holds every parameter and pool tensor, and that is
what is compared with the plan.

On a make-tiny V4 checkpoint (Flash-like, MXFP4 experts computed in process):
- a plan split over 2 "GPUs" (layers on both), with the embeddings on the GPU or the CPU, gives the
  greedy tokens of the one-device runner; its pool holds the plan's KV tokens; each planned device's
  weight bytes equal the plan's weight items of that GPU, to the byte, and /metrics' actual bytes
  tell the same per device (the pool's too);
- attention-weights bf16 (the FP8 linears dequantised) gives the same tokens too;
- the plan's hot experts (3 per layer, over 2 GPUs) held as stored MXFP4 give the tokens of the run
  without them, with each device's weight bytes the plan's (hot experts included); the same on a
  Pro-like checkpoint whose routed experts are block FP8, held as stored in Fp8Linear and counted so;
- what the V4 model cannot execute (hot experts of an unquantised checkpoint, re-quantised attention)
  is refused by name, and the serving / generate option checks accept --gpu, --embeddings,
  --min-kv-tokens, --attention-weights checkpoint and --gpu-experts (MXFP4) for V4 but refuse fp8 / int8.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from checkpoint.reader import CheckpointReader
from gpu_service import plan as P
from gpu_service.model.placement import Placement
from gpu_service.model.v4.moe import ReferenceExperts
from gpu_service.runtime.runner_v4 import V4Runner

KV, PAGE, STEPS = 512, 16, 24
NOT_WEIGHTS = ("workspace", "reserve", "kv_cache", "index_keys", "kv_window")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(dir, reader, in-process experts) of a tiny Flash-like V4 checkpoint."""
    from gpu_service.local import tiny

    d = str(tmp_path_factory.mktemp("v4plan") / "flash")
    tiny.make_tiny(d, fmt="mxfp4", arch="deepseek_v4", v4_schedule="flash", seed=11)
    reader = CheckpointReader(d, any_architecture=True)
    cfg = reader.config
    return d, reader, ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)


def _prompt() -> list[int]:
    """A seeded prompt past the tiny window and several compression blocks."""
    return torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def alone(ckpt):
    """The one-device runner's greedy tokens (no plan)."""
    _, reader, experts = ckpt
    r = V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV, page_size=PAGE)
    return r.generate(_prompt(), STEPS).token_ids


def _plan(reader, gpus, **kw):
    """A plan of the tiny checkpoint in float32 for `gpus`."""
    kw.setdefault("embeddings", "gpu")
    kw.setdefault("attention_weights", "checkpoint")
    kw.setdefault("gpu_experts", 0)
    return P.make_plan(reader.config, gpus, kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=64, max_batch=4,
                       dtype="float32", **kw)


def _runner(reader, experts, plan):
    """The V4 runner executing `plan` with its GPUs simulated by the CPU."""
    placement = Placement.from_plan(plan, [torch.device("cpu")] * len(plan.gpus))
    return V4Runner(reader, experts, dtype=torch.float32, placement=placement, page_size=PAGE), placement


@pytest.mark.parametrize("where", ["embeddings_on_first", "embeddings_on_host"])  # ("gpu" ids skip without CUDA)
def test_split_over_two_gpus_gives_the_one_device_tokens(ckpt, alone, where):
    _, reader, experts = ckpt
    embeddings = "gpu" if where == "embeddings_on_first" else "cpu"
    plan = _plan(reader, ["1GiB", "1GiB"], embeddings=embeddings)
    assert plan.fits and len(plan.gpus) == 2 and all(g.layers for g in plan.gpus)
    runner, placement = _runner(reader, experts, plan)
    assert set(placement.layer_gpu) == {0, 1}
    assert runner.pool.num_pages * runner.pool.page_size == plan.options.kv_tokens == KV
    assert runner.chunk_tokens == plan.options.chunk_tokens
    # each planned device's weights are the plan's weight items of that GPU (the CPU: the embeddings)
    got: dict[int, int] = {}
    for name, t in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
        g = placement.gpu_index_of(name)
        got[g] = got.get(g, 0) + t.untyped_storage().nbytes()
    for g, gp in enumerate(plan.gpus):
        want = sum(v for k, v in gp.items.items() if k not in NOT_WEIGHTS)
        print(f"embeddings {embeddings}: GPU {g} planned {want} B, placed {got.get(g, 0)} B")
        assert got.get(g, 0) == want, (g, got, gp.items)
    cfg = reader.config
    assert got.get(-1, 0) == (cfg.vocab_size * cfg.hidden_size * 4 if embeddings == "cpu" else 0)
    from gpu_service.metrics import actual_bytes

    metered = actual_bytes(runner)  # /metrics: weights and pool per planned device
    assert {k: v for k, v in metered.items() if k[0] == "weights"} == \
        {("weights", "cpu" if g < 0 else f"cuda:{g}"): b for g, b in got.items()}  # every buffer a full storage
    kv = {dev: v for (cat, dev), v in metered.items() if cat == "kv_cache"}
    assert set(kv) == {"cuda:0", "cuda:1"} and sum(kv.values()) == runner.pool.bytes()
    assert runner.generate(_prompt(), STEPS).token_ids == alone


def test_dequantised_attention_weights_give_the_same_tokens(ckpt, alone):
    from gpu_service.model.qlinear import Fp8Linear

    _, reader, experts = ckpt
    runner, _ = _runner(reader, experts, _plan(reader, ["1GiB"], attention_weights="bf16"))
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    assert runner.generate(_prompt(), STEPS).token_ids == alone


class _Recording:
    """An ExpertsFn passing calls through, keeping the weights each call sent."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def __call__(self, layer, h, ids, w):
        """Record (ids, weights) and call the wrapped experts."""
        self.sent.append((layer, ids.clone(), w.clone()))
        return self.inner(layer, h, ids, w)


@pytest.fixture(scope="module")
def pro(tmp_path_factory):
    """(dir, reader, in-process experts, the one-device runner's greedy tokens) of a tiny Pro-like
    checkpoint whose routed experts are block FP8 (e4m3 128x128 + ue8m0 scales, as a base release)."""
    from gpu_service.local import tiny

    d = str(tmp_path_factory.mktemp("v4plan") / "pro")
    tiny.make_tiny(d, fmt="fp8", arch="deepseek_v4", v4_schedule="pro", seed=11)
    reader = CheckpointReader(d, any_architecture=True)
    cfg = reader.config
    assert cfg.expert_dtype == "fp8" and reader.format_of("layers.3.ffn.experts.0.w1.weight") == "fp8_e8m0"
    experts = ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)
    r = V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV, page_size=PAGE)
    return d, reader, experts, r.generate(_prompt(), STEPS).token_ids


def _check_hot(reader, experts, alone, fmt: str, linear) -> None:
    """The plan's hot experts (3 per layer over 2 GPUs) held as stored in `linear` (the plan's hot
    format `fmt`), computed here on their layer's device and sent to the experts with weight 0: the
    tokens of the run without them, the weight bytes of each planned device equal to the plan's items
    (gpu_experts included)."""
    plan = _plan(reader, ["1GiB", "1GiB"], gpu_experts=3)
    assert plan.fits and all(g.items["gpu_experts"] for g in plan.gpus)
    cfg = reader.config
    per_expert = 2 * P.linear_bytes(cfg.moe_intermediate_size, cfg.hidden_size, fmt) + \
        P.linear_bytes(cfg.hidden_size, cfg.moe_intermediate_size, fmt)
    assert all(g.items["gpu_experts"] == 3 * per_expert * len([i for i in g.layers if cfg.is_moe_layer(i)])
               for g in plan.gpus)
    rec = _Recording(experts)
    runner, placement = _runner(reader, rec, plan)
    assert placement.expert_format == fmt
    assert placement.hot_experts and all(len(v) == 3 for v in placement.hot_experts.values())
    held = [n for n, m in runner.model.named_modules() if isinstance(m, linear) and ".ffn.experts." in n]
    assert len(held) == 3 * 3 * len(placement.hot_experts)
    got: dict[int, int] = {}
    for name, t in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
        got[placement.gpu_index_of(name)] = got.get(placement.gpu_index_of(name), 0) + t.untyped_storage().nbytes()
    for g, gp in enumerate(plan.gpus):
        print(f"hot {fmt}: GPU {g} planned {gp.items}, placed {got[g]} B")
        assert got[g] == sum(v for k, v in gp.items.items() if k not in NOT_WEIGHTS), (g, got, gp.items)
    assert runner.generate(_prompt(), STEPS).token_ids == alone
    hot_sent = sum(int(((ids[..., None] == torch.tensor(placement.hot_experts[layer])).any(-1) & (w == 0)).sum())
                   for layer, ids, w in rec.sent)
    assert hot_sent > 0  # hot experts were chosen, and computed here (weight 0 to the experts)
    assert all(bool((w[~(ids[..., None] == torch.tensor(placement.hot_experts[layer])).any(-1)] > 0).all())
               for layer, ids, w in rec.sent)  # every other expert keeps its weight


def test_hot_mxfp4_experts_give_the_shards_only_tokens(ckpt, alone):
    """Flash-like MXFP4 experts held as stored (Mxfp4Linear)."""
    from gpu_service.model.qlinear import Mxfp4Linear

    _, reader, experts = ckpt
    assert _plan(reader, ["1GiB"]).options.expert_format == "mxfp4"
    _check_hot(reader, experts, alone, "mxfp4", Mxfp4Linear)


def test_hot_fp8_experts_give_the_shards_only_tokens(pro):
    """Pro-like FP8 experts held as stored (Fp8Linear: e4m3 + f32 block scales), whatever format the
    plan gives the shards; the clamped SwiGLU applied (the tokens equal the shards-only run)."""
    from gpu_service.model.qlinear import Fp8Linear

    _, reader, experts, alone_pro = pro
    assert _plan(reader, ["1GiB"]).options.expert_format != "fp8"  # the shards' format: bf16/int8/int4
    _check_hot(reader, experts, alone_pro, "fp8", Fp8Linear)
    assert reader.config.swiglu_limit  # the limit the hot path's SharedExpert clamps with


def test_what_v4_cannot_execute_is_refused_by_name(ckpt, tmp_path):
    from gpu_service.local import tiny

    _, reader, experts = ckpt
    for aw in ("fp8", "int8"):
        placement = Placement.from_plan(_plan(reader, ["1GiB"], attention_weights=aw), [torch.device("cpu")])
        with pytest.raises(ValueError, match=f"--attention-weights {aw}"):
            V4Runner(reader, experts, dtype=torch.float32, placement=placement, page_size=PAGE)
    d = str(tmp_path / "bf16")  # unquantised routed experts: no hot GPU experts (held only as stored)
    tiny.make_tiny(d, fmt="bf16", arch="deepseek_v4", v4_schedule="pro", seed=11)
    plain = CheckpointReader(d, any_architecture=True)
    hot = Placement.from_plan(_plan(plain, ["1GiB"], gpu_experts=2), [torch.device("cpu")])
    assert hot.hot_experts and hot.expert_format not in ("mxfp4", "fp8")
    with pytest.raises(ValueError, match="--gpu-experts"):
        V4Runner(plain, experts, dtype=torch.float32, placement=hot, page_size=PAGE)
    from gpu_service.entrypoints import generate

    g = argparse.ArgumentParser()
    generate.add_arguments(g)
    assert generate.run(g.parse_args(["--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1",
                                      "--gpu-experts", "2"])) == 2


def test_serving_and_generate_options(ckpt, capsys):
    from gpu_service.entrypoints import generate, serve
    from gpu_service.entrypoints.serving import check_serving_args, plan_or_exit

    d = ckpt[0]
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    base = ["--model", d, "--page-size", str(PAGE), "--kv-tokens", str(KV), "--device", "cpu"]
    ok = base + ["--gpu", "1GiB", "--gpu", "1GiB", "--embeddings", "cpu", "--min-kv-tokens", "256",
                 "--attention-weights", "checkpoint", "--gpu-experts", "2"]
    args = p.parse_args(ok)
    assert check_serving_args(args) is None
    placement = plan_or_exit(args)
    assert placement is not None and set(placement.layer_gpu) == {0, 1} and placement.embeddings_on_cpu
    assert placement.kv_tokens == KV and all(len(v) == 2 for v in placement.hot_experts.values())
    err = check_serving_args(p.parse_args(base + ["--attention-weights", "int8"]))
    assert err is not None and "--attention-weights int8" in err and "DeepSeek-V4" in err
    g = argparse.ArgumentParser()
    generate.add_arguments(g)
    assert generate.run(g.parse_args(["--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1",
                                      "--attention-weights", "fp8"])) == 2
    assert "fp8" in capsys.readouterr().err
