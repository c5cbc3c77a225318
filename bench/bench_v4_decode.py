"""DeepSeek-V4 decode throughput on the tiny model: 1, 4 and 8 concurrent streams, this tree against a
reference commit (default: the merge base with main, i.e. before the batched decode), in one run.

Each measurement runs in its own process on one tree (this one, or the reference extracted with
`git archive` into a temporary directory, this script copied in): a tiny Flash-like V4 checkpoint
(gpu_service.local.tiny, MXFP4 experts computed in process by ReferenceExperts), the engine's
V4Runner on the CPU in float32 (paged pool, no prefix cache, no CUDA graphs), one torch thread.
Every stream gets a 64-token prompt (past the window and several CSA / HCA blocks), prefilled alone;
then all streams decode together through `runner.step` (one all-decode step per token): 4 warm-up
steps, then STEPS timed ones. tok/s = streams x steps / seconds. Trees alternate per round (the
machine is shared: compare within a round); the best round per tree and stream count, every round's
figures and the per-round after / before ratios are reported.

    python bench/bench_v4_decode.py [--ref COMMIT] [--steps 32] [--rounds 3] [--out bench/results/v4_decode.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAMS = (1, 4, 8)
PROMPT = 64


def measure(streams: int, steps: int, ckpt: str) -> dict:
    """One tree (the one this process imports): decode tok/s of `streams` concurrent streams."""
    sys.path.insert(0, ROOT)
    import torch

    from checkpoint.reader import CheckpointReader
    from gpu_service.model.kv import Chunk
    from gpu_service.model.v4.moe import ReferenceExperts
    from gpu_service.runtime.runner_v4 import V4Runner

    torch.set_num_threads(1)
    reader = CheckpointReader(ckpt, any_architecture=True)
    cfg = reader.config
    runner = V4Runner(reader, ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit),
                      device=torch.device("cpu"), dtype=torch.float32, kv_tokens=4096, page_size=16,
                      prefix_cache=False, cuda_graphs=False)
    g = torch.Generator().manual_seed(7)
    seqs, last = [], []
    for _ in range(streams):
        s = runner.new_seq()
        prompt = torch.randint(2, cfg.vocab_size, (PROMPT,), generator=g).tolist()
        last.append(int(runner.step(prompt, [Chunk(s, 0, PROMPT)])[0].argmax()))
        seqs.append(s)
    t0 = None
    for i in range(4 + steps):
        if i == 4:
            t0 = time.perf_counter()
        logits = runner.step(last, [Chunk(s, s.length, 1) for s in seqs])
        last = logits.argmax(-1).tolist()
    dt = time.perf_counter() - t0
    return {"streams": streams, "steps": steps, "seconds": round(dt, 4),
            "tok_per_s": round(streams * steps / dt, 2), "ms_per_step": round(1000 * dt / steps, 3)}


def _tree(ref: str, tmp: str) -> str:
    """The reference commit's files in tmp (this script and the built extensions copied in)."""
    d = os.path.join(tmp, "ref")
    os.makedirs(d)
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "**", "*.so"), recursive=True):
        rel = os.path.relpath(so, ROOT)
        if not rel.startswith((".venv", "build")):
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            shutil.copy(so, os.path.join(d, rel))
    os.makedirs(os.path.join(d, "bench"), exist_ok=True)
    shutil.copy(os.path.abspath(__file__), os.path.join(d, "bench", os.path.basename(__file__)))
    return d


def _run(tree: str, streams: int, steps: int, ckpt: str) -> dict:
    """`measure` in a fresh process importing `tree`."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, os.path.join(tree, "bench", os.path.basename(__file__)), "--measure",
                          str(streams), "--steps", str(steps), "--ckpt", ckpt],
                         cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    """Parse the flags; measure one tree (--measure) or compare this tree with the reference."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=None, help="reference commit (default: git merge-base HEAD main)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "v4_decode.json"))
    ap.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure is not None:
        print(json.dumps(measure(a.measure, a.steps, a.ckpt)))
        return
    ref = a.ref or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"], check=True,
                                  capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-v4-") as tmp:
        sys.path.insert(0, ROOT)
        from cpu_expert_service.probes import cpu_description
        from gpu_service.local.tiny import make_tiny

        ckpt = os.path.join(tmp, "tiny-v4")
        make_tiny(ckpt, fmt="mxfp4", arch="deepseek_v4", v4_schedule="flash", seed=11)
        trees = {"before": _tree(ref, tmp), "after": ROOT}
        best: dict = {k: {} for k in trees}
        rounds: list = []
        for r in range(a.rounds):
            for n in STREAMS:
                for name, tree in trees.items():
                    m = _run(tree, n, a.steps, ckpt)
                    rounds.append({"round": r, "tree": name, "streams": n, "tok_per_s": m["tok_per_s"]})
                    print(f"round {r} {name} streams {n}: {m['tok_per_s']} tok/s", file=sys.stderr)
                    if n not in best[name] or m["tok_per_s"] > best[name][n]["tok_per_s"]:
                        best[name][n] = m
    result = {"bench": "v4_decode", "cpu": cpu_description(), "torch_threads": 1, "dtype": "float32",
              "model": "make-tiny deepseek_v4 flash (mxfp4 experts in process)", "prompt_tokens": PROMPT,
              "before": {"commit": ref, "runs": [best["before"][n] for n in STREAMS]},
              "after": {"commit": head, "runs": [best["after"][n] for n in STREAMS]},
              "speedup_best": {str(n): round(best["after"][n]["tok_per_s"] / best["before"][n]["tok_per_s"], 2)
                               for n in STREAMS},
              "speedup_per_round": {str(n): [round(x["tok_per_s"] / y["tok_per_s"], 2) for x, y in zip(
                  [q for q in rounds if q["tree"] == "after" and q["streams"] == n],
                  [q for q in rounds if q["tree"] == "before" and q["streams"] == n])] for n in STREAMS},
              "rounds": rounds, "load_average_after": os.getloadavg()}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
