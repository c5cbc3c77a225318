"""DeepSeek-V4's memory plan holds at peak, measured on CPU (the V3 / V3.2 test: tests/test_peak_memory.py).

What is measured: a tiny V4 checkpoint (one CSA and one HCA layer) is served by the engine's V4Runner
(its paged pool of the plan's `kv_tokens` tokens allocated before the steps, no prefix cache); one
sequence runs a chunked prefill at the plan's chunk size up to nearly that pool and tens of greedy
decode steps through `runner.step`, all under the byte tracker (tests/memtrack.py), everything charged
to the one planned GPU except the routed experts' computation (the CPU shards' work; their result lands
in a GPU buffer, charged to the GPU). Each step's transient is its high-water mark above what was alive
when the step began (the weights, the pool and the sequence's bounded state); the largest is compared
with the plan's `workspace` item for the same config, kv_tokens, chunk_tokens and max_batch.

The prefill's short remainder runs first, so the last chunk is a full one at the end of the prompt:
a worst step (the indexer scores every CSA entry so far; the attention's blocks read an HCA layer's
every entry or a CSA query's gathered picks, which barely grow). Two shapes: many attention heads (the
attention block's scores dominate) and many indexer heads (the indexer's block scores dominate). The
bound: transient <= the plan's workspace (the promise) and >= 75% of it without the CUDA-graph pools (a
CPU run captures none): the remaining slack is the MLP's projections, the routing and the logits, which
the formula adds beside the attention peak although they are never alive with it, and the HCA and CSA
extras, which the formula adds in one block though they belong to different layers; a formula that
overcounts the scores (the dominant term) by a third would fail. The decode steps are checked against
the same formula for one token of one sequence.

With hot GPU experts (8 of 16 per layer, MXFP4 and FP8 checkpoints held as stored, their
dequantisation scratch and transient counted by the plan) the same bounds hold, and each MoE call
(routing, shared and hot experts with their dequantisation, the routed output) is measured against
its share of the formula (`moe` with its hot term, the rows' MLP part, the scratch): within it, and
at least 70% of it when every row of a chunk picks the same hot experts (a repeated token on the
hash layer: the case the hot term assumes).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

from gpu_service import plan as P
from gpu_service.local.tiny import make_tiny
from gpu_service.model.experts_api import Ready
from gpu_service.model.kv import Chunk
from gpu_service.model.placement import Placement
from gpu_service.model.v4.load import load_v4
from gpu_service.runtime.runner_v4 import V4Runner
from gpu_service.plan.bytes_v4 import hot_experts_bytes_v4, workspace_bytes_v4
from tests.memtrack import ByteTracker

BASE = {"num_hidden_layers": 2, "compress_ratios": [4, 16, 0], "num_hash_layers": 1, "sliding_window": 128,
        "index_topk": 64, "max_position_embeddings": 4096}
SHAPES = {
    "attention": {**BASE, "num_attention_heads": 16, "index_n_heads": 16},
    "indexer": {**BASE, "num_attention_heads": 4, "index_n_heads": 128},
}
CHUNK, KV, DECODE, MAX_BATCH = 256, 1280, 24, 4
HOT = 8  # hot GPU experts per layer (of 16) in the runs with hot experts
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


def moe_stage_tracker(model, tracker: ByteTracker) -> list[int]:
    """Hooks on every layer's MoE (`ffn`) recording each call's high-water mark above what was alive
    when it began (the routing, the shared and hot experts with their dequantisation, the routed
    output), without disturbing the step's own high-water mark. Returns the list they fill."""
    out: list[int] = []
    saved: list[tuple[int, int]] = []

    def pre(module, args):
        live = tracker.live[GPU]
        saved.append((live, tracker.peak[GPU]))
        tracker.peak[GPU] = live

    def post(module, args, result):
        live0, peak0 = saved.pop()
        out.append(tracker.peak[GPU] - live0)
        tracker.peak[GPU] = max(peak0, tracker.peak[GPU])

    for blk in model.layers:
        blk.ffn.register_forward_pre_hook(pre)
        blk.ffn.register_forward_hook(post)
    return out


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
    """bf16 checkpoints of every shape, and the attention shape with MXFP4 / FP8 routed experts (hot
    GPU experts are held as the checkpoint stores them)."""
    root = tmp_path_factory.mktemp("peak_v4")
    out = {name: make_tiny(str(root / name), fmt="bf16", seed=3, overrides=ov, arch="deepseek_v4")
           for name, ov in SHAPES.items()}
    for fmt in ("mxfp4", "fp8"):
        out[f"attention-{fmt}"] = make_tiny(str(root / fmt), fmt=fmt, seed=3, overrides=SHAPES["attention"],
                                            arch="deepseek_v4")
    return out


def gp_scratch(plan, hot: int) -> int:
    """The plan's dequantisation scratch of the hot experts (0 without)."""
    cfg, o = plan.cfg, plan.options
    fmt = P.arch_bytes(cfg).hot_format(cfg, o.expert_format)
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    return max(P.qlinear_scratch_bytes(I, H, fmt, o.eb), P.qlinear_scratch_bytes(H, I, fmt, o.eb)) if hot else 0


def moe_share(plan, hot: int) -> int:
    """The MoE's share of a chunk's step in the plan's formula: the routing and routed output (`moe`,
    the hot experts' term included), the MLP part of each row (its output and 3 widths) and the hot
    experts' dequantisation scratch."""
    cfg, o = plan.cfg, plan.options
    width = max(cfg.n_shared_experts * cfg.moe_intermediate_size, cfg.moe_intermediate_size if hot else 0)
    return (4 * CHUNK * cfg.hidden_size + 12 * CHUNK * cfg.num_experts_per_tok + hot_experts_bytes_v4(cfg, o)
            + o.eb * CHUNK * (cfg.hidden_size + 3 * width) + gp_scratch(plan, hot))


def measure(model_dir: str, dtype: str, gpu_experts: int = 0, token: int | None = None):
    """(plan, (the plan's workspace without CUDA-graph pools, the same for one token of one sequence),
    per-step transients, the model's weight bytes, the bytes the sequence's cache holds at the end,
    the hot experts' calls, the largest MoE call's transient). With `gpu_experts`, the plan's hot
    experts run on the planned GPU (the runner executes the plan's placement). With `token`, the
    prompt is that token repeated and the hash layer's hot experts are the ones its `tid2eid` row
    picks: every row of a chunk goes to each of them (the hot path's worst case)."""
    loaded = load_v4(model_dir, dtype=getattr(torch, dtype))
    cfg = loaded.config
    plan = P.make_plan(cfg, ["1GiB"], kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=CHUNK, max_batch=MAX_BATCH,
                       embeddings="gpu", attention_weights="bf16", gpu_experts=gpu_experts, dtype=dtype)
    assert plan.fits and plan.options.kv_tokens == KV
    ws_kw = dict(mlp_width=max(cfg.n_shared_experts * cfg.moe_intermediate_size,
                               cfg.moe_intermediate_size if gpu_experts else 0), lm_head=True,
                 layers=cfg.num_hidden_layers, scratch=gp_scratch(plan, gpu_experts))
    assert workspace_bytes_v4(cfg, plan.options, **ws_kw) == plan.gpus[0].items["workspace"]
    no_graphs = workspace_bytes_v4(cfg, dataclasses.replace(plan.options, cuda_graphs=False), **ws_kw)
    # the same formula for one token of one sequence: what a decode step of this run may keep (its row
    # padded to the CPU's GEMM row block, gpu_service.model.rows: the batched decode runs those rows; 1 on CUDA)
    rows = loaded.model.row_block(torch.device("cpu"))
    one_token = workspace_bytes_v4(cfg, dataclasses.replace(plan.options, cuda_graphs=False, chunk_tokens=1,
                                                            max_batch=rows), **ws_kw)
    tracker = ByteTracker()
    # the engine's runner: its model, its paged pool of KV tokens (allocated before the steps), no prefix cache
    hot_ids = None
    if token is not None:
        picked = loaded.model.layers[0].ffn.gate.tid2eid[token].tolist()  # layer 0: hash-routed
        rest = [e for e in range(cfg.n_routed_experts) if e not in picked]
        hot_ids = {layer: sorted(picked + rest[:gpu_experts - len(picked)]) if layer == 0 else
                   list(range(gpu_experts)) for layer in cfg.moe_layers}
    placement = Placement.from_plan(plan, [torch.device("cpu")], hot_ids) if gpu_experts else None
    runner = V4Runner(loaded.reader, HostExperts(loaded.experts, tracker), device=torch.device("cpu"),
                      dtype=getattr(torch, dtype), kv_tokens=KV, prefix_cache=False, placement=placement)
    model, seq = runner.model, runner.new_seq()
    del loaded.model
    calls = [0]
    for name, m in model.named_modules():
        if name.endswith(".w2") and ".ffn.experts." in name:  # one call per hot expert's rows
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    moe_stage = moe_stage_tracker(model, tracker)

    def step(tokens: list[int]) -> torch.Tensor:
        """The engine's V4 step of one sequence's chunk -> the logits of its last token."""
        return runner.step(tokens, [Chunk(seq, seq.length, len(tokens))])[0]

    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(PROMPT)] if token is None else [token] * PROMPT
    with tracker:
        transients, logits = run_steps(step, prompt, CHUNK, DECODE, tracker)
    del logits  # so that what stays alive is the cache
    weights = sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers()))
    return (plan, (no_graphs, one_token), transients, weights, runner.pool.bytes() + tracker.live[GPU], calls[0],
            max(moe_stage))


@pytest.mark.parametrize("shape,dtype,hot", [("attention", "float32", 0), ("indexer", "float32", 0),
                                             ("attention", "bfloat16", 0), ("attention-mxfp4", "bfloat16", HOT),
                                             ("attention-mxfp4", "float32", HOT), ("attention-fp8", "bfloat16", HOT)])
def test_v4_transient_peak_within_planned_workspace(checkpoints, shape, dtype, hot):
    plan, (no_graphs, one_token), transients, weights, cache, calls, moe = measure(checkpoints[shape], dtype, hot)
    assert (calls > 0) == bool(hot)  # the hot experts ran on the planned GPU (their dequantisation included)
    moe_terms = moe_share(plan, hot)
    print(f"  MoE stage (hot {hot}): transient high-water {moe} B, the formula's MoE terms {moe_terms} B "
          f"({moe / moe_terms:.1%})")
    assert moe <= moe_terms, f"a MoE call kept {moe} B, the formula's MoE terms are {moe_terms} B"
    assert plan.options.gpu_experts == hot
    gp = plan.gpus[0]
    ws, peak = gp.items["workspace"], max(transients)
    kv_items = gp.items["kv_cache"] + gp.items["index_keys"] + gp.items["kv_window"] // MAX_BATCH
    print(f"V4 {shape} {dtype} hot {hot}: transient high-water {peak} B, planned workspace {ws} B ({peak / ws:.1%}), "
          f"{no_graphs} B without graph pools ({peak / no_graphs:.1%}); the sequence's cache holds {cache} B, "
          f"the plan's pool + one sequence's window {kv_items} B")
    # what is alive when the steps start: the weights, exactly the plan's weight items
    assert weights == sum(v for k, v in gp.items.items()
                          if k not in ("workspace", "reserve", "kv_cache", "index_keys", "kv_window"))
    assert len(transients) == -(-PROMPT // CHUNK) + DECODE
    assert peak <= ws, f"the V4 step kept {peak} B, the plan's workspace is {ws} B"
    assert peak <= no_graphs, f"the V4 step kept {peak} B, the plan's workspace without graph pools {no_graphs} B"
    assert peak >= 0.75 * no_graphs, f"planned workspace {no_graphs} B (no graph pools) overcounts the {peak} B kept"
    # the prefill's last full chunk is a worst step (the indexer's scores grow with the entries; the attention
    # block's keys barely do, CSA queries gathering their picks); decode steps stay far below it
    assert transients[-(-PROMPT // CHUNK) - 1] == peak
    assert max(transients[-DECODE:]) < 0.1 * peak
    decode = max(transients[-DECODE:])
    print(f"  decode steps: transient high-water {decode} B, one-token workspace {one_token} B "
          f"({decode / one_token:.1%})")
    assert decode <= one_token, f"a decode step kept {decode} B, the formula for one token gives {one_token} B"


@pytest.mark.parametrize("shape,dtype", [("attention-mxfp4", "float32"), ("attention-fp8", "bfloat16")])
def test_v4_hot_experts_worst_case_within_the_formula(checkpoints, shape, dtype):
    """Every row of a chunk routed to the same hot experts (a repeated token on the hash layer, its
    tid2eid experts hot): the largest MoE call stays within the formula's MoE share, which is then
    no large over-count (the hot term assumes exactly this case), and the step within the workspace."""
    plan, (no_graphs, _), transients, _, _, calls, moe = measure(checkpoints[shape], dtype, HOT, token=5)
    share = moe_share(plan, HOT)
    print(f"V4 {shape} {dtype} hot {HOT}, every row to the hot experts: largest MoE call {moe} B, the formula's "
          f"MoE share {share} B ({moe / share:.1%}); step high-water {max(transients)} B of {no_graphs} B")
    assert calls > 0 and max(transients) <= no_graphs
    assert 0.7 * share <= moe <= share
