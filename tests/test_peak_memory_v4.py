"""DeepSeek-V4's memory plan holds at peak, measured on CPU (the V3 / V3.2 test: tests/test_peak_memory.py).

What is measured: a tiny V4 checkpoint (one CSA and one HCA layer) is loaded, then one sequence runs
a chunked prefill at the plan's chunk size up to nearly the plan's pool of `kv_tokens` tokens and tens
of greedy decode steps, all under the byte tracker (tests/memtrack.py), everything charged to the one
planned GPU except the routed experts' computation (the CPU shards' work; their result lands in a
GPU buffer, charged to the GPU). Each step's transient is its high-water mark above what was alive
when the step began (the weights and the sequence's cache so far); the largest is compared with the
plan's `workspace` item for the same config, kv_tokens, chunk_tokens and max_batch. The cache the
V4 model grows during a step (new window keys, compressor state, entries) is counted in it: in the
engine it lives in the preallocated pool, so this only makes the check stricter.

The prefill's short remainder runs first, so the last chunk is a full one at the end of the prompt:
the worst step, whose queries read the most compressed entries (the torch attention reads every
entry of its layer, the CSA picks being a mask). Two shapes: many attention heads (the attention
scores dominate) and many indexer heads (the indexer's scores dominate). The bound: transient <= the
plan's workspace (the promise) and >= 75% of it without the CUDA-graph pools (a CPU run captures
none): the remaining slack is the MLP's projections, the routing and the logits, which the formula
adds beside the attention peak although they are never alive with it, and a partial last decode
step; a formula that overcounts the scores (the dominant term) by a third would fail. (Measured
over other shapes too, window-only, HCA-only, hidden 512, chunk 32, 4 heads: 72-93% in f32 and bf16.)
The decode steps are checked against the same formula for one token of one sequence (an upper
bound only: the torch model keeps the entries in its cache, where the formula counts them gathered).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

from gpu_service import plan as P
from gpu_service.local.tiny import make_tiny
from gpu_service.model.experts_api import Ready
from gpu_service.model.v4.load import load_v4
from gpu_service.plan.bytes_v4 import workspace_bytes_v4
from tests.memtrack import ByteTracker

BASE = {"num_hidden_layers": 2, "compress_ratios": [4, 16, 0], "num_hash_layers": 1, "sliding_window": 128,
        "index_topk": 64, "max_position_embeddings": 4096}
SHAPES = {
    "attention": {**BASE, "num_attention_heads": 16, "index_n_heads": 16},
    "indexer": {**BASE, "num_attention_heads": 4, "index_n_heads": 64},
}
CHUNK, KV, DECODE, MAX_BATCH = 256, 1280, 24, 4
PROMPT = KV - DECODE
GPU = "gpu0"


class HostExperts:
    """An ExpertsFn that computes the routed experts off the planned GPU (label "host": the CPU
    shards' work) and returns their output as a fresh tensor charged to the GPU, as the shards'
    result arrives in a GPU buffer."""

    def __init__(self, inner, tracker: ByteTracker):
        self.inner, self.tracker = inner, tracker

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Ready:
        label, self.tracker.label = self.tracker.label, "host"
        try:
            out = self.inner(layer, h, ids, w).wait()
        finally:
            self.tracker.label = label
        return Ready(out.clone())


def run_steps(step: Callable[[list[int]], torch.Tensor], prompt: list[int], chunk: int, decode: int,
              tracker: ByteTracker, label: str = GPU) -> tuple[list[int], torch.Tensor]:
    """One sequence through `step(tokens) -> logits of its last token [V]` (the model or a runner,
    continuing the sequence's cache): the prompt in chunks of `chunk` tokens, the remainder first, then
    `decode` greedy tokens, under `tracker` (which must be active) with `label` current. Returns each
    step's transient (high-water mark above the bytes `label` had when the step began) and the logits."""
    cuts = [0] + list(range(len(prompt) % chunk or chunk, len(prompt) + 1, chunk))
    parts = [prompt[a:b] for a, b in zip(cuts, cuts[1:])] + [None] * decode
    transients, logits = [], None
    for part in parts:
        tokens = part if part is not None else [int(logits.argmax())]
        tracker.label = label
        start = tracker.reset_peak().get(label, 0)
        logits = step(tokens)
        transients.append(tracker.peak[label] - start)
    tracker.label = None
    return transients, logits


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the ops are small and the machine's cores are shared, where torch's
    thread pool makes these steps several times slower (the bytes are the same)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peak_v4")
    return {name: make_tiny(str(root / name), fmt="bf16", seed=3, overrides=ov, arch="deepseek_v4")
            for name, ov in SHAPES.items()}


def measure(model_dir: str, dtype: str):
    """(plan, (the plan's workspace without CUDA-graph pools, the same for one token of one sequence),
    per-step transients, the model's weight bytes, the bytes the sequence's cache holds at the end)."""
    loaded = load_v4(model_dir, dtype=getattr(torch, dtype))
    cfg, model = loaded.config, loaded.model
    plan = P.make_plan(cfg, ["1GiB"], kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=CHUNK, max_batch=MAX_BATCH,
                       embeddings="gpu", attention_weights="bf16", gpu_experts=0, dtype=dtype)
    assert plan.fits and plan.options.kv_tokens == KV
    ws_kw = dict(mlp_width=cfg.n_shared_experts * cfg.moe_intermediate_size, lm_head=True,
                 layers=cfg.num_hidden_layers)
    assert workspace_bytes_v4(cfg, plan.options, **ws_kw) == plan.gpus[0].items["workspace"]
    no_graphs = workspace_bytes_v4(cfg, dataclasses.replace(plan.options, cuda_graphs=False), **ws_kw)
    # the same formula for one token of one sequence: what a decode step of this run may keep
    one_token = workspace_bytes_v4(cfg, dataclasses.replace(plan.options, cuda_graphs=False, chunk_tokens=1,
                                                            max_batch=1), **ws_kw)
    tracker = ByteTracker()
    experts = HostExperts(loaded.experts, tracker)
    cache = model.new_cache()
    device = model.embed.weight.device

    def step(tokens: list[int]) -> torch.Tensor:
        """The V4 model's step of one sequence (an engine's V4 runner can stand in here)."""
        return model.forward_batch([(torch.tensor(tokens, device=device), cache)], experts)[0]

    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(PROMPT)]
    with tracker:
        transients, logits = run_steps(step, prompt, CHUNK, DECODE, tracker)
    del logits  # so that what stays alive is the cache
    weights = sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers()))
    return plan, (no_graphs, one_token), transients, weights, tracker.live[GPU]


@pytest.mark.parametrize("shape,dtype", [("attention", "float32"), ("indexer", "float32"),
                                         ("attention", "bfloat16")])
def test_v4_transient_peak_within_planned_workspace(checkpoints, shape, dtype):
    plan, (no_graphs, one_token), transients, weights, cache = measure(checkpoints[shape], dtype)
    gp = plan.gpus[0]
    ws, peak = gp.items["workspace"], max(transients)
    kv_items = gp.items["kv_cache"] + gp.items["index_keys"] + gp.items["kv_window"] // MAX_BATCH
    print(f"V4 {shape} {dtype}: transient high-water {peak} B, planned workspace {ws} B ({peak / ws:.1%}), "
          f"{no_graphs} B without graph pools ({peak / no_graphs:.1%}); the sequence's cache holds {cache} B, "
          f"the plan's pool + one sequence's window {kv_items} B")
    # what is alive when the steps start: the weights, exactly the plan's weight items
    assert weights == sum(v for k, v in gp.items.items()
                          if k not in ("workspace", "reserve", "kv_cache", "index_keys", "kv_window"))
    assert len(transients) == -(-PROMPT // CHUNK) + DECODE
    assert peak <= ws, f"the V4 step kept {peak} B, the plan's workspace is {ws} B"
    assert peak <= no_graphs, f"the V4 step kept {peak} B, the plan's workspace without graph pools {no_graphs} B"
    assert peak >= 0.75 * no_graphs, f"planned workspace {no_graphs} B (no graph pools) overcounts the {peak} B kept"
    # the prefill's last full chunk is the worst step; decode steps stay far below it
    assert transients.index(peak) == -(-PROMPT // CHUNK) - 1
    assert max(transients[-DECODE:]) < 0.1 * peak
    decode = max(transients[-DECODE:])
    print(f"  decode steps: transient high-water {decode} B, one-token workspace {one_token} B "
          f"({decode / one_token:.1%})")
    assert decode <= one_token, f"a decode step kept {decode} B, the formula for one token gives {one_token} B"
