"""DeepSeek-V4's batched decode (gpu_service.model.v4.decode, attention.decode_core) through the
engine's V4Runner and its paged pool, float32 on the CPU, in-process experts (row-invariant:
ReferenceExperts pads each expert's rows to the GEMM row block).

- 8 sequences of different lengths (3 .. 290 tokens: short ones, ones past the window of 8 and many
  CSA blocks of 4 / HCA blocks of 16, one whose CSA entries pass 64 so its batches take a larger
  entry bucket than the others alone) started at staggered steps, prompts in chunks of 16 beside the
  others' decode tokens, then all decoding together: each sequence's logits at every step are
  bitwise equal to its run alone (same chunks), its tokens too;
- the static-shape step (`set_cuda_graphs(mode="static")`: rows padded to the graph bucket, the
  layer pieces called on the static buffers under the capture check) gives the unpadded eager run's
  logits bit for bit, with pieces captured and replayed;
- on a GPU (marked `gpu`, skipped here): the same steps captured as CUDA graphs and replayed give
  the eager run's tokens.
"""
from __future__ import annotations

import pytest
import torch

from checkpoint.reader import CheckpointReader
from gpu_service.model.kv import Chunk
from gpu_service.model.v4.moe import ReferenceExperts
from gpu_service.runtime.runner_v4 import V4Runner

KV, PAGE, CHUNK, STEPS = 1024, 16, 16, 10
LENGTHS = [3, 7, 12, 20, 33, 58, 101, 290]
START = [0, 2, 0, 5, 1, 3, 0, 4]  # the step at which each sequence's prompt starts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(reader, in-process experts) of a tiny Flash-like V4 checkpoint (CSA, HCA and window layers)."""
    from gpu_service.local import tiny

    d = str(tmp_path_factory.mktemp("v4dec") / "flash")
    tiny.make_tiny(d, fmt="mxfp4", arch="deepseek_v4", v4_schedule="flash", seed=13)
    reader = CheckpointReader(d, any_architecture=True)
    cfg = reader.config
    assert {0, 4}.issubset(set(cfg.compress_ratios[:cfg.num_hidden_layers])) and cfg.sliding_window < 20
    return reader, ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)


def _prompts() -> list[list[int]]:
    return [torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(40 + i)).tolist()
            for i, n in enumerate(LENGTHS)]


def _runner(ckpt, device: str = "cpu", graphs: str | None = None) -> V4Runner:
    reader, experts = ckpt
    r = V4Runner(reader, experts, device=torch.device(device), dtype=torch.float32, kv_tokens=KV, page_size=PAGE,
                 prefix_cache=False, cuda_graphs=False)
    if graphs is not None:
        r.set_cuda_graphs(True, mode=graphs)
    return r


def _schedule(runner: V4Runner, prompts: list[list[int]], starts: list[int]) -> list[list[torch.Tensor]]:
    """Engine-like steps: sequence j's prompt in chunks of CHUNK from step starts[j], then STEPS greedy
    tokens; every step runs all sequences with work at once. Returns each sequence's logits per sample."""
    seqs = [runner.new_seq() for _ in prompts]
    fed, out, logits = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
    step = 0
    while any(len(o) < STEPS for o in out):
        ids, chunks, who = [], [], []
        for j, p in enumerate(prompts):
            if step < starts[j] or len(out[j]) >= STEPS:
                continue
            part = p[fed[j]:fed[j] + CHUNK] if fed[j] < len(p) else out[j][-1:]
            ids += part
            chunks.append(Chunk(seqs[j], seqs[j].length, len(part)))
            fed[j] += len(part) if fed[j] < len(p) else 0
            who.append(j)
        for j, lg in zip(who, runner.step(ids, chunks)):
            if fed[j] == len(prompts[j]):
                logits[j].append(lg.clone())
                out[j].append(int(lg.argmax()))
        step += 1
    for s in seqs:
        s.free()
    return logits


def _alone(runner: V4Runner, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    return [_schedule(runner, [p], [0])[0] for p in prompts]


def test_batched_decode_each_sequence_equals_its_alone_run_bitwise(ckpt):
    runner = _runner(ckpt)
    prompts = _prompts()
    alone = _alone(runner, prompts)
    together = _schedule(runner, prompts, START)
    for j in range(len(prompts)):
        assert [int(x.argmax()) for x in together[j]] == [int(x.argmax()) for x in alone[j]], f"sequence {j} tokens"
        for t, (a, b) in enumerate(zip(alone[j], together[j])):
            assert torch.equal(a, b), f"sequence {j} (length {LENGTHS[j]}) step {t}: logits differ from its alone run"
    assert len({tuple(int(x.argmax()) for x in lg) for lg in together}) == len(prompts)
    assert runner.pool.pages_in_use == 0


def test_static_shape_step_equals_the_unpadded_run(ckpt):
    """The exact step CUDA graphs capture (rows padded to the bucket, the pieces called on their static
    buffers under the capture check) run eagerly on CPU: logits bitwise equal to the unpadded run."""
    prompts = _prompts()[:5]
    eager = _schedule(_runner(ckpt), prompts, [0] * 5)
    runner = _runner(ckpt, graphs="static")
    runner.graphs.buckets = tuple(b for b in runner.graphs.buckets if b >= 8) or (8,)  # 5 rows padded to 8
    static = _schedule(runner, prompts, [0] * 5)
    for j in range(5):
        assert all(torch.equal(a, b) for a, b in zip(eager[j], static[j])), f"sequence {j}"
    sets = runner.graphs.sets
    assert sets and all(rows == 8 for (_, _, rows) in sets) and runner.graphs.captured() > 0
    assert sum(s.replays for s in sets.values()) > 0


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_on_gpu(ckpt):
    """Captured and replayed on CUDA: the greedy tokens of the eager CUDA run (8 sequences)."""
    reader, experts = ckpt

    def cuda_experts(layer, h, ids, w):
        from gpu_service.model.experts_api import Ready
        return Ready(experts(layer, h.cpu(), ids.cpu(), w.cpu()).wait().to(h.device))

    prompts = _prompts()
    chunks = [-(-n // CHUNK) for n in LENGTHS]
    starts = [max(chunks) - c for c in chunks]  # every prompt done at the same step: then 8 rows decode together
    want, got = [], []
    for graphs in (False, True):
        r = V4Runner(reader, cuda_experts, device=torch.device("cuda"), dtype=torch.float32, kv_tokens=KV,
                     page_size=PAGE, prefix_cache=False, cuda_graphs=graphs)
        assert (r.graphs is not None) == graphs
        lg = _schedule(r, prompts, starts)
        (got if graphs else want).append([[int(x.argmax()) for x in s] for s in lg])
        if graphs:
            assert r.graphs.disabled is None and r.graphs.captured() > 0
            assert sum(s.replays for s in r.graphs.sets.values()) > 0 and 8 in {b for (_, _, b) in r.graphs.sets}
    assert got == want
