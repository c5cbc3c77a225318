"""Short decode/prefill benchmark of the GPU service on CUDA vs CPU (in-process experts), for
`make gpu-check`, and decode with CUDA graphs vs eager at batch 1/8/32 (equal tokens, ms per step). Prints JSON
and writes it to --out; exits 1 if the graphs changed the tokens."""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.reader import CheckpointReader  # noqa: E402
from cpu_expert_service.server import load_shard  # noqa: E402
from gpu_service.experts.handoff import LocalExperts  # noqa: E402
from gpu_service.runtime.runner import ModelRunner  # noqa: E402
from gpu_service.local.tiny import make_tiny  # noqa: E402


def linear_times(devices, shapes=((7168, 2048), (4096, 7168)), tokens=(1, 512)):
    """Time per call of one bf16 / fp8 / int8 linear [out, in] (DeepSeek-V3 sizes: q_a/o_proj/dense
    q_a, part of a dense gate) at decode and prefill token counts, in the compute dtype of each device."""
    from gpu_service.model.qlinear import make_quantized

    rows = []
    for dev in devices:
        dt = torch.bfloat16 if dev == "cuda" else torch.float32
        for out, inp in (shapes if dev == "cuda" else shapes[:1]):
            w = torch.randn(out, inp) * 0.02
            for fmt in ("bf16", "fp8", "int8"):
                lin = make_quantized(w, fmt, torch.device(dev))
                if fmt == "bf16":
                    lin = lin.to(dt)
                for t in tokens:
                    x = torch.randn(t, inp, device=dev, dtype=dt)
                    with torch.inference_mode():
                        lin(x)
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        n, t0 = 5, time.perf_counter()
                        for _ in range(n):
                            lin(x)
                        if dev == "cuda":
                            torch.cuda.synchronize()
                    rows.append({"device": dev, "format": fmt, "shape": [out, inp], "tokens": t,
                                 "ms_per_call": round((time.perf_counter() - t0) / n * 1e3, 3)})
            del w
    return rows


def decode_batch(runner, prompts, steps):
    """Greedy decode of several sequences through ModelRunner.step on CUDA: (tokens per step,
    seconds per step, synchronised). Also used by tests/test_gpu.py."""
    from gpu_service.model.kv import Chunk

    seqs = [runner.new_seq() for _ in prompts]
    try:
        logits = runner.step(sum(prompts, []), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)])
        toks, times = [], []
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            toks.append(nxt)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = runner.step(nxt, [Chunk(s, s.length, 1) for s in seqs])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return toks, times
    finally:
        for s in seqs:
            s.free()


def graphs_vs_eager(reader, experts, batches=(1, 8, 32), steps=32):
    """Decode steps on CUDA (bf16) with the decode segments as CUDA graphs (default) and eager
    (--no-cuda-graphs): equal greedy tokens, median ms per step of each."""
    rows = []
    V = reader.config.vocab_size
    for B in batches:
        prompts = [[(13 * i + 5 * j + 1) % V for j in range(8 + i)] for i in range(B)]
        got = {}
        for graphs in (False, True):
            r = ModelRunner(reader, experts, device=torch.device("cuda"), dtype=torch.bfloat16, kv_tokens=8192,
                            cuda_graphs=graphs)  # 32 sequences of <= 72 tokens: 2 pages of 64 each
            toks, times = decode_batch(r, prompts, steps)
            got[graphs] = (toks, sorted(times[2:])[len(times[2:]) // 2] * 1e3)
            del r
        rows.append({"batch": B, "tokens_equal": got[True][0] == got[False][0],
                     "ms_per_step_eager": round(got[False][1], 3), "ms_per_step_graphs": round(got[True][1], 3)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per timed run")
    args = ap.parse_args()
    d = make_tiny(tempfile.mkdtemp(prefix="bench-gpu-"), fmt="bf16", seed=0,
                  overrides={"hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 8192})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    experts = LocalExperts(backend)
    results = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for dtype in ([torch.float32, torch.bfloat16] if dev == "cuda" else [torch.float32]):
            r = ModelRunner(reader, experts, device=torch.device(dev), dtype=dtype, kv_tokens=1024)
            r.generate(list(range(1, 9)), 4)  # warm-up
            t0 = time.perf_counter()
            res = r.generate(list(range(1, 257)), args.tokens)
            results.append({"device": dev, "dtype": str(dtype).replace("torch.", ""), **res.timings,
                            "wall_s": round(time.perf_counter() - t0, 3)})
    out = {"bench": "gpu-service decode (tiny wide model, in-process numpy experts)", "results": results,
           "linears": linear_times(devices)}
    if torch.cuda.is_available():
        out["cuda_graphs_vs_eager"] = graphs_vs_eager(reader, experts)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not all(r["tokens_equal"] for r in out.get("cuda_graphs_vs_eager", [])):
        print("bench_gpu: CUDA graphs changed the greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
