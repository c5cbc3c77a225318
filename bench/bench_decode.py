"""The decode step's fixed cost per MoE layer, the expert hand-off alone, and what concurrent
streams get out of batching, on the one decode path of the model.

Part 1, the hand-off alone: bench/bench_handoff.py (one MoE layer's expert call round trip over
shared memory with the shard's C doorbell loop, b1 and b8, µs), run in the same session.

Part 2, fixed cost. Tiny bf16 checkpoints (gpu_service.local.tiny) with 3 and 27 layers
(first_k_dense_replace=1: 2 and 26 MoE layers). The runner's decode step (`ModelRunner.step`, one
token per sequence, every sequence with a 16-token history) is timed with

  null  an experts function that returns zeros at once (no transport, no expert math),
  shm   2 real shard processes over the shared-memory fast path (RemoteExperts),
  shm1  1 shard process holding every expert over shared memory (on a 2-core VM: the GPU side and
        the shard each have a core, as in a deployment with dedicated cores),
  tcp   the same 2 shards over the TCP data path,

at batch 1 and 8. Interleaved rounds in one run (the machine is shared: compare ratios).
Per MoE layer = (t27 - t3) / 24: what one more MoE layer costs a step outside the expert math (for
shm / tcp including the round trip to the shards and their tiny expert math). A profile of the
27-layer step at batch 1 (null experts) lists the top torch ops and Python frames.

Part 3, streams: `moesplit serve` (tiny bf16, 3 layers, 2 shards, default backend and flags) with
1, 8 and 32 concurrent streaming completions (64 tokens each, ignore_eos): aggregate decode tokens/s.

The CPU here runs the GPU service's torch code in float32 on one thread: the same code a GPU runs,
without CUDA graphs (their figures come from `make gpu-check`, bench_gpu.py). `lscpu`'s model name
is recorded beside the figures.

Writes bench/results/decode.json and decode.png.

    python bench/bench_decode.py [--quick] [--skip-serve]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpu_expert_service.probes import cpu_description  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
CACHE = os.environ.get("MOESPLIT_BENCH_CACHE", os.path.join(tempfile.gettempdir(), "moesplit-bench-cache"))
DEPTHS = (3, 27)
HISTORY = 16  # tokens each sequence has cached before the timed decode steps


def tiny(layers: int) -> str:
    from gpu_service.local.tiny import make_tiny

    d = os.path.join(CACHE, f"tiny-bf16-{layers}l")
    if not os.path.exists(os.path.join(d, "generation_config.json")):
        make_tiny(d, "bf16", seed=0, overrides={"num_hidden_layers": layers})
    return d


class NullExperts:
    """An experts function that starts nothing and returns zeros: the step's own cost only."""

    def __call__(self, layer, h, ids, w):
        from gpu_service.model.experts_api import Ready

        return Ready(h.new_zeros(h.shape))


def time_steps(runner, batch: int, steps: int) -> float:
    """Seconds per decode step at `batch` sequences (median of `steps`), after a 16-token prefill."""
    from gpu_service.model.kv import Chunk

    rng = np.random.default_rng(batch)
    V = runner.cfg.vocab_size
    seqs = [runner.new_seq() for _ in range(batch)]
    try:
        prompt = [int(t) for t in rng.integers(4, V, HISTORY * batch)]
        runner.step(prompt, [Chunk(s, 0, HISTORY) for s in seqs])
        out = []
        for _ in range(steps):
            toks = [int(t) for t in rng.integers(4, V, batch)]
            t0 = time.perf_counter()
            runner.step(toks, [Chunk(s, s.length, 1) for s in seqs])
            out.append(time.perf_counter() - t0)
        return float(np.median(out))
    finally:
        for s in seqs:
            s.free()


def fixed_cost(rounds: int, steps: int, transports: tuple[str, ...]) -> dict:
    import torch

    from checkpoint.reader import CheckpointReader
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.local.stack import start_shards
    from gpu_service.experts.handoff import RemoteExperts
    from gpu_service.runtime.runner import ModelRunner

    runners, experts, stacks, clients = {}, {}, [], []
    try:
        for L in DEPTHS:
            d = tiny(L)
            reader = CheckpointReader(d)
            ex = {"null": NullExperts()}
            if set(transports) - {"null", "shm1"}:
                sh = start_shards(d, 2, backend="auto", timeout_s=300)
                stacks.append(sh)
                for t in transports:
                    if t not in ("null", "shm1"):
                        c = ExpertsClient(sh.addresses, reader.config, transport=t, timeout_s=60).connect()
                        clients.append(c)
                        ex[t] = RemoteExperts(c)
            if "shm1" in transports:  # one shard process: the GPU side and the shard each have a core
                sh = start_shards(d, 1, backend="auto", timeout_s=300)
                stacks.append(sh)
                c = ExpertsClient(sh.addresses, reader.config, transport="shm", timeout_s=60).connect()
                clients.append(c)
                ex["shm1"] = RemoteExperts(c)
            experts[L] = ex
            runners[L] = ModelRunner(reader, ex["null"], device=torch.device("cpu"), dtype=torch.float32,
                                     kv_tokens=64 * (HISTORY + steps + 64), page_size=16)
        rec: dict = {}
        keys = [(t, b) for t in transports for b in (1, 8)]
        for L in DEPTHS:  # warm-up
            for t, b in keys:
                runners[L].experts = experts[L][t]
                time_steps(runners[L], b, 3)
        for r in range(rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for t, b in order:
                for L in DEPTHS:
                    runners[L].experts = experts[L][t]
                    rec.setdefault(f"{t}/b{b}", {}).setdefault(L, []).append(time_steps(runners[L], b, steps))
        out = {}
        for key, by_L in rec.items():
            t3, t27 = np.array(by_L[3]), np.array(by_L[27])
            per_layer = (t27 - t3) / 24  # paired per round
            out[key] = {"step_us_3_layers": round(float(np.median(t3)) * 1e6, 1),
                        "step_us_27_layers": round(float(np.median(t27)) * 1e6, 1),
                        "per_moe_layer_us": round(float(np.median(per_layer)) * 1e6, 1),
                        "per_moe_layer_us_rounds": [round(float(x) * 1e6, 1) for x in per_layer]}
        return {"results": out, "profile": profile(runners[27], experts[27]["null"])}
    finally:
        for c in clients:
            c.close()
        for s in stacks:
            s.stop()


def profile(runner, null, steps: int = 30, what: str = "null") -> dict:
    """Top torch ops (self CPU time) and Python frames (tottime) of 27-layer decode steps at batch 1."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    runner.experts = null
    time_steps(runner, 1, 3)
    with tprofile(activities=[ProfilerActivity.CPU]) as p:
        time_steps(runner, 1, steps)
    ops = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    top_ops = [{"op": e.key, "calls_per_step": round(e.count / (steps + 1), 1),
                "self_us_per_step": round(e.self_cpu_time_total / (steps + 1), 1)} for e in ops]
    pr = cProfile.Profile()
    pr.enable()
    time_steps(runner, 1, steps)
    pr.disable()
    st = pstats.Stats(pr)
    frames = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
    top_frames = [{"frame": f"{os.path.relpath(f, ROOT) if f.startswith(ROOT) else os.path.basename(f)}:{ln}({fn})",
                   "calls_per_step": round(v[1] / (steps + 1), 1), "tottime_us_per_step": round(v[2] / (steps + 1) * 1e6, 1)}
                  for (f, ln, fn), v in frames]
    del torch
    return {"what": f"27 layers, batch 1, {what} experts; per step (incl. the prefill step, /steps+1)",
            "top_torch_ops": top_ops, "top_python_frames": top_frames}


# ---- part 2: moesplit serve with concurrent streams ---------------------------------------------
def serve_streams(streams: tuple[int, ...], rounds: int, max_tokens: int) -> dict:
    """Aggregate decode tokens/s of `moesplit serve` (tiny, 3 layers, defaults) per stream count:
    gpu_service.local.loadgen, the measurement `moesplit bench` makes."""
    from gpu_service.local.loadgen import ServeProcess, decode_tokens_per_s, run_streams

    with ServeProcess(tiny(3)) as srv:
        run_streams(srv.port, 4, 8)  # warm-up
        out = {}
        for n in streams:
            rates = [decode_tokens_per_s(run_streams(srv.port, n, max_tokens)) for _ in range(rounds)]
            out[n] = round(float(np.median(rates)), 1)
        return out


def plot(res: dict, path: str) -> None:
    """Per-MoE-layer fixed cost by transport / batch, and serve streams' tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = res["fixed_cost"]["results"]
    keys = sorted(R)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    axes[0].bar(np.arange(len(keys)), [R[k]["per_moe_layer_us"] for k in keys])
    axes[0].set_xticks(np.arange(len(keys)), keys, rotation=30, ha="right")
    axes[0].set_ylabel("µs per MoE layer (median)")
    axes[0].set_title("decode step fixed cost per MoE layer")
    sv = res.get("serve_decode_tokens_per_s", {})
    n = [1, 8, 32]
    axes[1].bar(np.arange(3), [sv.get(k, 0) for k in n])
    axes[1].set_xticks(np.arange(3), [f"{k} streams" for k in n])
    axes[1].set_ylabel("aggregate decode tokens/s")
    axes[1].set_title("moesplit serve, tiny bf16, 2 shards")
    fig.suptitle(f"moesplit decode step ({res['machine']['cpu']}, {res['machine']['cpus']} CPUs; compare ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def handoff() -> dict:
    """bench/bench_handoff.py's JSON (the hand-off alone), run as its own process."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_handoff.py")], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"bench_handoff.py failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout[r.stdout.index("{"):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (a smoke run)")
    ap.add_argument("--skip-serve", action="store_true", help="part 1 only")
    ap.add_argument("--transports", default="null,shm,shm1,tcp")
    ap.add_argument("--skip-handoff", action="store_true", help="without part 1 (bench_handoff.py)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as bench_pipeline: the "GPU side" on one CPU thread, the shards on the rest
    t_start = time.perf_counter()
    os.makedirs(CACHE, exist_ok=True)
    res: dict = {"machine": {"cpu": cpu_description(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                             "python": platform.python_version(), "torch": torch.__version__, "torch_threads": 1},
                 "definition": __doc__}
    if not args.skip_handoff:
        res["handoff"] = handoff()
        print("[hand-off alone]", json.dumps(res["handoff"].get("summary", res["handoff"])), flush=True)
    fc = fixed_cost(2 if args.quick else 5, 10 if args.quick else 40, tuple(args.transports.split(",")))
    res["fixed_cost"] = fc
    for k, v in fc["results"].items():
        print(f"[fixed cost] {k}: 3 layers {v['step_us_3_layers']} us, 27 layers {v['step_us_27_layers']} us, "
              f"per MoE layer {v['per_moe_layer_us']} us", flush=True)
    if not args.skip_serve:
        r = serve_streams((1, 8, 32), 1 if args.quick else 2, 64)
        res["serve_decode_tokens_per_s"] = {**r, "x32_over_x1": round(r[32] / r[1], 2)}
        print(f"[serve] aggregate decode tok/s {r} (32 / 1 = {r[32] / r[1]:.2f}x)", flush=True)
        res["targets"] = {"serve_32_over_1_streams": {"value": res["serve_decode_tokens_per_s"]["x32_over_x1"],
                                                      "target": ">= 6"}}
        for t in res["targets"].values():
            t["met"] = bool(t["value"] >= float(t["target"].split()[1]))
        print(json.dumps(res["targets"], indent=1))
    if fc.get("profile"):
        for e in fc["profile"]["top_torch_ops"][:8]:
            print("  op", e)
        for e in fc["profile"]["top_python_frames"][:8]:
            print("  py", e)
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "decode.json"), "w") as f:
        json.dump(res, f, indent=2)
    plot(res, os.path.join(RESULTS, "decode.png"))
    print(f"wrote {RESULTS}/decode.json and decode.png in {res['wall_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
