"""The decode step's fixed cost per MoE layer, and what concurrent streams get out of batching.

Part 1, fixed cost (issue 20). Tiny bf16 checkpoints (gpu_service.local.tiny) with 3 and 27 layers
(first_k_dense_replace=1: 2 and 26 MoE layers). The runner's decode step (`ModelRunner.step`, one
token per sequence, every sequence with a 16-token history) is timed with

  null  an experts function that returns zeros at once (no transport, no expert math),
  shm   2 real shard processes over the shared-memory fast path (RemoteExperts),
  shmpy the same with the shards serving their doorbells in Python (MOESPLIT_SHM_NATIVE=0),
  shm1  1 shard process holding every expert over shared memory (on this 2-core VM: the GPU side and
        the shard each have a core, as in a deployment with dedicated cores; 2 shards oversubscribe it),
  tcp   the same shards over the TCP data path,

at batch 1 and 8, for the decode paths `plain` (the per-sequence reference, MLA's Python loop over
sequences), `fused` (batched paged attention and the torch fused step, fast_decode.py: what CUDA runs,
without graphs here), `layers` (the native C layers, native_decode.py, driven from Python) and `fast`
(the default: on this CPU float32 runner the whole step, shared-memory hand-offs included, in C:
native_remote.c; with null / TCP experts the same as `layers`). `fused` and `layers` hand each layer
call to the shards through C as well (runtime/native_calls.py); `fused-py` / `layers-py` are the same
with the hand-offs through the client's Python (MOESPLIT_NATIVE_HANDOFF=0), timed for the shared-memory
transports only. Interleaved rounds in one run (the machine is shared: compare ratios).
Per MoE layer = (t27 - t3) / 24: what one more MoE layer costs a step outside the expert math
(for shm / tcp including the round trip to the shards and their tiny expert math).
Profiles of the 27-layer fast path at batch 1 (null experts, and shm) list the top torch ops and
Python frames.

Part 2, streams: `moesplit serve` (tiny bf16, 3 layers, 2 shards, default backend and flags) with
1, 8 and 32 concurrent streaming completions (64 tokens each, ignore_eos): aggregate decode
tokens/s, for each decode path (MOESPLIT_DECODE_PATH).

Findings (this 2-core AVX2 VM, torch CPU, 1 thread; the machine is shared, so ratios are what count):
- the native C layers (gpu_service/model/native_decode.c: three calls per layer) cut null b1 from
  ~840 µs (fused) to ~100 µs per MoE layer: under the 150 µs target; what remains is Python around
  the calls, the null experts' zeros and the generator hand-off;
- over shared memory the hand-off was Python on both sides: with the C layers (`layers`) the fast
  path's own floor was ~155 µs per call with one shard (FastPath.send ~29 µs, the shard serving
  ~77-85 µs of which ~30 computing, the rest its Python), the client's futures and routing ~40 µs.
  A C ping-pong over the same SOCK_SEQPACKET doorbell between two processes on this VM takes
  ~15 µs (~25 µs of overhead with 100 / 30 µs of work on either side), so the wake-ups were not the
  floor. With the shard's doorbell loop in C (kernels/moe_shm.c) a one-token call's round trip is
  ~39 µs (server ~10 µs, of which ~10 computing) against ~146 µs; with the whole step in C as well
  (native_remote.c) one more MoE layer over 2 shard processes costs ~96-101 µs at b1 (target
  <= 250) against ~420 µs for `layers` and ~270 µs with the shards' loop in Python (`shmpy`);
- every torch op costs >= 3 µs of dispatch, so the fixed cost is the op count: the fused decode
  step (gpu_service/model/fast_decode.py) cut null/fast b1 from ~1,560-1,600 to ~840-940 µs per MoE
  layer and b8 from ~3,230-3,280 to ~1,670-1,780 µs (b8 runs two ping-pong micro-batches: each layer
  twice); shm b1 ~2,600 -> ~1,550-1,830, b8 ~5,700 -> ~3,440-3,670 (quick runs, back to back);
- F.rms_norm on a [1, 96] row costs 30-43 µs, vector_norm + 4 elementwise ops ~20 µs; einsum ~35 µs
  against ~5 µs for the bmm it becomes; a Python scalar operand costs ~4 µs more than a 0-d tensor
  (it is wrapped per call), masked_fill with a scalar ~18 µs against torch.where's ~8;
- a CPU GEMM row in a partial block of four rows takes another summation order: rows are padded to
  a multiple of 4 for bit-identical results alone or batched (not only to at least 4);
- torch.compile (inductor, also cpp_wrapper) of a norm + router + shared-expert segment was slower
  than eager here (305 / 218 µs against 221-240 µs) and compiling took 5-25 s: not adopted;
- (an earlier reading, "the shm excess over null is the transport's wake-ups", was wrong: it was the
  Python on both ends of the doorbell, see above);
- the serve streams pay per token for the engine (detokenising, metrics) and the HTTP stream
  (one SSE chunk each): with the step in C, 32 streams get ~6-7x one stream's tokens/s, the single
  stream being ~1.5x faster than with `layers`; one loop wake-up per step for all streams
  (runtime/requests._LoopWakes) and the label children of the experts observer looked up once
  raised 32 streams by ~5-10%;
- CUDA graphs (gpu_service/model/cuda_graphs.py) replace the per-op launches on a GPU; their
  numbers come from `make gpu-check` (bench_gpu.py: graphs vs eager ms per step).

Writes bench/results/decode.json and decode.png.

    python bench/bench_decode.py [--quick] [--skip-serve]
"""
from __future__ import annotations

import argparse
import cProfile
import http.client
import json
import os
import platform
import pstats
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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


def set_path(runner, path: str) -> None:
    """Select the decode path of a runner ('plain' reference or 'fast'), where the runner has one;
    a '-py' suffix: with every expert hand-off through the client's Python (MOESPLIT_NATIVE_HANDOFF=0)."""
    base = path.removesuffix("-py")
    if hasattr(runner, "set_decode_path"):
        runner.set_decode_path(base)
        runner.model.native_handoff = not path.endswith("-py")
    elif path != "plain":
        raise SystemExit("this tree has no fast decode path")


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


def fixed_cost(rounds: int, steps: int, transports: tuple[str, ...], paths: tuple[str, ...]) -> dict:
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
            if set(transports) - {"null", "shm1", "shmpy"}:
                sh = start_shards(d, 2, backend="auto", timeout_s=300)
                stacks.append(sh)
                for t in transports:
                    if t not in ("null", "shm1", "shmpy"):
                        c = ExpertsClient(sh.addresses, reader.config, transport=t, timeout_s=60).connect()
                        clients.append(c)
                        ex[t] = RemoteExperts(c)
            if "shm1" in transports:  # one shard process: the GPU side and the shard each have a core
                sh = start_shards(d, 1, backend="auto", timeout_s=300)
                stacks.append(sh)
                c = ExpertsClient(sh.addresses, reader.config, transport="shm", timeout_s=60).connect()
                clients.append(c)
                ex["shm1"] = RemoteExperts(c)
            if "shmpy" in transports:  # 2 shards serving their doorbells in Python (MOESPLIT_SHM_NATIVE=0)
                os.environ["MOESPLIT_SHM_NATIVE"] = "0"
                try:
                    sh = start_shards(d, 2, backend="auto", timeout_s=300)
                finally:
                    del os.environ["MOESPLIT_SHM_NATIVE"]
                stacks.append(sh)
                c = ExpertsClient(sh.addresses, reader.config, transport="shm", timeout_s=60).connect()
                clients.append(c)
                ex["shmpy"] = RemoteExperts(c)
            experts[L] = ex
            runners[L] = ModelRunner(reader, ex["null"], device=torch.device("cpu"), dtype=torch.float32,
                                     kv_tokens=64 * (HISTORY + steps + 64), page_size=16)
        rec: dict = {}
        # ('-py' only differs where a shared-memory path can be claimed)
        keys = [(t, p, b) for t in transports for p in paths for b in (1, 8)
                if not p.endswith("-py") or t in ("shm", "shmpy", "shm1")]
        for L in DEPTHS:  # warm-up
            for t, p, b in keys:
                runners[L].experts = experts[L][t]
                set_path(runners[L], p)
                time_steps(runners[L], b, 3)
        for r in range(rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for t, p, b in order:
                for L in DEPTHS:
                    runners[L].experts = experts[L][t]
                    set_path(runners[L], p)
                    rec.setdefault(f"{t}/{p}/b{b}", {}).setdefault(L, []).append(time_steps(runners[L], b, steps))
        out = {}
        for key, by_L in rec.items():
            t3, t27 = np.array(by_L[3]), np.array(by_L[27])
            per_layer = (t27 - t3) / 24  # paired per round
            out[key] = {"step_us_3_layers": round(float(np.median(t3)) * 1e6, 1),
                        "step_us_27_layers": round(float(np.median(t27)) * 1e6, 1),
                        "per_moe_layer_us": round(float(np.median(per_layer)) * 1e6, 1),
                        "per_moe_layer_us_rounds": [round(float(x) * 1e6, 1) for x in per_layer]}
        prof = profile(runners[27], experts[27]["null"], paths[-1])
        res = {"results": out, "profile": prof}
        if "shm" in transports:  # the whole step in C: what Python is left per step
            res["profile_shm"] = profile(runners[27], experts[27]["shm"], paths[-1], what="shm (2 shards)")
        return res
    finally:
        for c in clients:
            c.close()
        for s in stacks:
            s.stop()


def profile(runner, null, path: str, steps: int = 30, what: str = "null") -> dict:
    """Top torch ops (self CPU time) and Python frames (tottime) of 27-layer decode steps at batch 1."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    runner.experts = null
    set_path(runner, path)
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
    return {"what": f"27 layers, batch 1, {what} experts, {path} path; per step (incl. the prefill step, /steps+1)",
            "top_torch_ops": top_ops, "top_python_frames": top_frames}


# ---- part 2: moesplit serve with concurrent streams ---------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, max_tokens: int, seed: int, rec: list) -> None:
    body = json.dumps({"model": "tiny", "prompt": f"Hello number {seed}, the quick brown fox", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = c.getresponse()
    stamps = []
    for line in resp:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            stamps.append(time.perf_counter())
    c.close()
    rec.append(stamps)


def serve_streams(streams: tuple[int, ...], rounds: int, max_tokens: int, decode_path: str) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    base = decode_path.removesuffix("-py")
    if base != "fast":
        env["MOESPLIT_DECODE_PATH"] = base
    else:
        env.pop("MOESPLIT_DECODE_PATH", None)
    if decode_path.endswith("-py"):
        env["MOESPLIT_NATIVE_HANDOFF"] = "0"
    else:
        env.pop("MOESPLIT_NATIVE_HANDOFF", None)
    log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False)
    p = subprocess.Popen([sys.executable, "-m", "moesplit", "serve", "--model", tiny(3), "--served-model-name", "tiny",
                          "--port", str(port), "--grpc-port", "0", "--log-level", "WARNING"],
                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moesplit serve did not come up; log {log.name}")
            time.sleep(0.5)
        _run_streams(port, 4, 8)  # warm-up
        out = {}
        for n in streams:
            rates = []
            for _ in range(rounds):
                recs = _run_streams(port, n, max_tokens)
                first = min(r[0] for r in recs)
                last = max(r[-1] for r in recs)
                toks = sum(len(r) - 1 for r in recs)  # tokens after each stream's first
                rates.append(toks / (last - first))
            out[n] = round(float(np.median(rates)), 1)
        return out
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _run_streams(port: int, n: int, max_tokens: int) -> list:
    rec: list = []
    th = [threading.Thread(target=_stream, args=(port, max_tokens, i, rec)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if len(rec) != n or any(len(r) < 2 for r in rec):
        raise RuntimeError("a stream returned fewer than 2 chunks")
    return rec


def plot(res: dict, path: str) -> None:
    """Per-MoE-layer fixed cost by transport / batch (plain vs fast) and serve streams' tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = res["fixed_cost"]["results"]
    paths = [p for p in ("plain", "fused-py", "fused", "layers-py", "layers", "fast") if any(f"/{p}/" in k for k in R)]
    keys = sorted({k.split("/")[0] + "/" + k.split("/")[2] for k in R})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    xs = np.arange(len(keys))
    bw = 0.8 / max(1, len(paths))
    for j, p in enumerate(paths):
        vals = [R.get(k.replace("/", f"/{p}/", 1), {}).get("per_moe_layer_us", 0) for k in keys]
        axes[0].bar(xs + (j - (len(paths) - 1) / 2) * bw, vals, bw, label=p)
    axes[0].set_xticks(xs, keys, rotation=30, ha="right")
    axes[0].set_yscale("log")  # plain is ~20x the fast paths
    axes[0].set_ylabel("µs per MoE layer (median, log scale)")
    axes[0].set_title("decode step fixed cost per MoE layer")
    axes[0].legend()
    sv = res.get("serve_decode_tokens_per_s", {})
    bw = 0.8 / max(1, len(sv))
    for j, p in enumerate(sv):
        n = [1, 8, 32]
        axes[1].bar(np.arange(3) + (j - (len(sv) - 1) / 2) * bw, [sv[p].get(k, sv[p].get(str(k), 0)) for k in n], bw,
                    label=p)
        axes[1].set_xticks(np.arange(3), [f"{k} streams" for k in n])
    axes[1].set_ylabel("aggregate decode tokens/s")
    axes[1].set_title("moesplit serve, tiny bf16, 2 shards")
    axes[1].legend()
    fig.suptitle(f"moesplit decode step ({res['machine']['cpus']} CPUs, shared: compare ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (a smoke run)")
    ap.add_argument("--skip-serve", action="store_true", help="part 1 only")
    ap.add_argument("--paths", default="plain,fused-py,fused,layers-py,layers,fast",
                    help="decode paths to compare (plain: the reference; fused: the torch fused step; layers: the "
                         "native C layers driven from Python; fast: the default; '-py': with the expert "
                         "hand-offs in the client's Python instead of C)")
    ap.add_argument("--transports", default="null,shm,shmpy,shm1,tcp")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as bench_pipeline: the "GPU side" on one CPU thread, the shards on the rest
    t_start = time.perf_counter()
    os.makedirs(CACHE, exist_ok=True)
    paths = tuple(args.paths.split(","))
    res: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                             "python": platform.python_version(), "torch": torch.__version__, "torch_threads": 1},
                 "definition": __doc__}
    fc = fixed_cost(2 if args.quick else 5, 10 if args.quick else 40, tuple(args.transports.split(",")), paths)
    res["fixed_cost"] = fc
    for k, v in fc["results"].items():
        print(f"[fixed cost] {k}: 3 layers {v['step_us_3_layers']} us, 27 layers {v['step_us_27_layers']} us, "
              f"per MoE layer {v['per_moe_layer_us']} us", flush=True)
    if not args.skip_serve:
        res["serve_decode_tokens_per_s"] = {}
        for p in paths:
            r = serve_streams((1, 8, 32), 1 if args.quick else 2, 64, p)
            res["serve_decode_tokens_per_s"][p] = {**r, "x32_over_x1": round(r[32] / r[1], 2)}
            print(f"[serve, {p}] aggregate decode tok/s {r} (32 / 1 = {r[32] / r[1]:.2f}x)", flush=True)
    R = fc["results"]
    if "fast" in paths:
        res["targets"] = {
            "in_process_per_moe_layer_us_b1": {"value": R["null/fast/b1"]["per_moe_layer_us"], "target": "<= 150"},
        }
        if "shm/fast/b1" in R:
            res["targets"]["shm_per_moe_layer_us_b1"] = {"value": R["shm/fast/b1"]["per_moe_layer_us"], "target": "<= 250"}
        if "shm1/fast/b1" in R:  # the same target with one shard process (each process its own core here)
            res["targets"]["shm1_per_moe_layer_us_b1"] = {"value": R["shm1/fast/b1"]["per_moe_layer_us"],
                                                          "target": "<= 250"}
        if "serve_decode_tokens_per_s" in res:
            res["targets"]["serve_32_over_1_streams"] = {
                "value": res["serve_decode_tokens_per_s"]["fast"]["x32_over_x1"], "target": ">= 6"}
        for t in res["targets"].values():
            op, lim = t["target"].split()
            t["met"] = bool(t["value"] <= float(lim)) if op == "<=" else bool(t["value"] >= float(lim))
        print(json.dumps(res["targets"], indent=1))
    if "plain" in paths and "fast" in paths:
        res["fast_over_plain_per_moe_layer"] = {
            k.replace("/fast", ""): round(R[k]["per_moe_layer_us"] / R[k.replace("/fast", "/plain")]["per_moe_layer_us"], 3)
            for k in R if "/fast/" in k}
        print("fast / plain per MoE layer:", res["fast_over_plain_per_moe_layer"])
    ratios = {f"{t}/{p}/b{b}": round(R[f"{t}/{p}/b{b}"]["per_moe_layer_us"] / R[f"{t}/{p}-py/b{b}"]["per_moe_layer_us"], 3)
              for t in ("shm", "shmpy", "shm1") for p in ("fused", "layers") for b in (1, 8)
              if f"{t}/{p}/b{b}" in R and f"{t}/{p}-py/b{b}" in R}
    if ratios:
        res["c_over_python_handoff_per_moe_layer"] = ratios
        print("C / Python hand-off per MoE layer:", ratios)
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
