"""The memory plan holds at peak, not only after load, measured on CPU.

A byte tracker over torch's dispatch (tests/memtrack.py) is wrapped around load, a long chunked
prefill at the plan's chunk size and tens of decode steps; each planned GPU is simulated by the CPU
and the bytes are charged to the planned device whose layers are running. On a tiny model the fixed
items (CUDA context, reserve) dwarf everything, so the transient high-water mark (above what is
alive when the steps start: weights and KV pool) is compared with the plan's `workspace` item
alone, at shapes where attention dominates (a long prompt, many heads): it must lie between 50%
and 100% of the planned workspace — a bound that holds and is tight.
"""
from __future__ import annotations

import os

import pytest
import torch

from checkpoint.reader import CheckpointReader
from cpu_expert_service.server import load_shard
from gpu_service import plan as P
from gpu_service.local.tiny import make_tiny
from gpu_service.model.kv import Chunk
from gpu_service.model.placement import allocated_bytes_by_gpu, Placement
from gpu_service.experts.handoff import LocalExperts
from gpu_service.runtime.runner import ModelRunner
from tests.memtrack import attribute_layers, ByteTracker

# long prompt and many heads: the prefill attention workspace dominates every other transient
OVERRIDES = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 16,
             "num_key_value_heads": 16, "max_position_embeddings": 4096}
CHUNK, KV, PROMPT, DECODE = 256, 1280, 1152, 16

OPTIONS = {
    "split": dict(gpus=["1GiB", "1GiB"]),
    "cpu_embeddings": dict(embeddings="cpu"),
    "fp8": dict(attention_weights="fp8"),
    "int8": dict(attention_weights="int8"),
    "gpu_experts": dict(gpu_experts=3),
    "v32": dict(arch="deepseek_v32"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peak")
    out = {}
    for arch in ("deepseek_v3", "deepseek_v32"):
        d = make_tiny(str(root / arch), fmt="bf16", seed=3, overrides=OVERRIDES, arch=arch)
        _, backend, _ = load_shard(d, None, None, "numpy")
        out[arch] = (CheckpointReader(d), LocalExperts(backend))
    return out


def measure(reader, experts, option: dict, dtype: str = "float32", plan_dtype: bool = True):
    """Plan, then load + chunked prefill + decode under the tracker. Returns (plan, placement,
    transient high-water per planned GPU, weights per planned GPU, last logits)."""
    kw = dict(option)
    kw.pop("arch", None)
    gpus = kw.pop("gpus", ["1GiB"])
    base = dict(embeddings="gpu", attention_weights="bf16", gpu_experts=0)
    base.update(kw)
    if plan_dtype:
        base["dtype"] = dtype
    plan = P.make_plan(reader.config, gpus, kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=CHUNK, max_batch=4, **base)
    assert plan.fits
    placement = Placement.from_plan(plan, [torch.device("cpu")] * len(plan.gpus))
    tracker = ByteTracker()
    ids = [(7 * i + 3) % reader.config.vocab_size for i in range(PROMPT)]
    with tracker:
        runner = ModelRunner(reader, experts, dtype=getattr(torch, dtype), placement=placement, page_size=64)
        handles = attribute_layers(runner.model, placement, tracker)
        base_live = tracker.reset_peak()
        seq = runner.new_seq()
        for s in range(0, PROMPT, CHUNK):
            part = ids[s:s + CHUNK]
            logits = runner.step(part, [Chunk(seq, s, len(part))])
        for _ in range(DECODE):
            logits = runner.step([int(logits[0].argmax())], [Chunk(seq, seq.length, 1)])
        tracker.label = None
    for h in handles:
        h.remove()
    transient = tracker.transient(base_live)
    peaks = [transient.get(f"gpu{g}", 0) for g in range(len(plan.gpus))]
    weights = allocated_bytes_by_gpu(runner.model, placement, runner.pool)
    return plan, placement, peaks, weights, logits[0].clone()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_transient_peak_within_planned_workspace(checkpoints, name):
    reader, experts = checkpoints[OPTIONS[name].get("arch", "deepseek_v3")]
    plan, placement, peaks, weights, _ = measure(reader, experts, OPTIONS[name])
    for g, gp in enumerate(plan.gpus):
        ws = gp.items["workspace"]
        print(f"{name} gpu{g}: transient high-water {peaks[g]} B, planned workspace {ws} B ({peaks[g] / ws:.0%})")
        assert peaks[g] <= ws, f"gpu{g}: the forward pass kept {peaks[g]} B, the plan's workspace is {ws} B"
        assert peaks[g] >= 0.5 * ws, f"gpu{g}: planned workspace {ws} B is over twice the {peaks[g]} B kept"
        # the per-device total bounds the high-water mark: weights + KV (equal to the plan) + transient
        assert weights.get(g, 0) + peaks[g] <= gp.used_bytes - gp.items["reserve"]


def test_plan_key_block_is_what_attention_uses(checkpoints):
    reader, experts = checkpoints["deepseek_v3"]
    plan = P.make_plan(reader.config, ["1GiB"], kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=CHUNK, max_batch=4,
                       attention_weights="bf16", embeddings="gpu", gpu_experts=0, dtype="float32")
    runner = ModelRunner(reader, experts, dtype=torch.float32,
                         placement=Placement.from_plan(plan, [torch.device("cpu")]), page_size=64)
    assert {blk.self_attn.key_block for blk in runner.model.model.layers} == {min(KV, CHUNK)}


if __name__ == "__main__":  # python -m tests.test_peak_memory [OPTION...]: print the high-water marks
    import sys
    import tempfile

    old = os.environ.get("PEAK_OLD_PLAN") == "1"  # the plan as it was before it counted the compute dtype
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[1:] or list(OPTIONS):
            arch = OPTIONS[name].get("arch", "deepseek_v3")
            d = make_tiny(os.path.join(tmp, arch), fmt="bf16", seed=3, overrides=OVERRIDES, arch=arch)
            _, backend, _ = load_shard(d, None, None, "numpy")
            plan, _, peaks, _, _ = measure(CheckpointReader(d), LocalExperts(backend), OPTIONS[name],
                                           plan_dtype=not old)
            print(name, "transient high-water", peaks, "planned workspace", [g.items["workspace"] for g in plan.gpus])
