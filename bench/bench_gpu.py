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
from cpu_expert_service.shard_load import load_shard  # noqa: E402
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


def real_shapes_layer(preset="deepseek-v3", batches=(1, 8, 32), steps=8, device="cuda", overrides=None):
    """One MoE layer at a preset's real dimensions (MLA, router, shared expert; the vocabulary cut to
    8192, routed experts answered with zeros and not timed), random bf16 weights built in memory (no
    checkpoint on disk): decode ms per step eager and with CUDA graphs (CUDA), equal greedy tokens."""
    import numpy as np

    from checkpoint.config import ModelConfig
    from checkpoint.names import expected_shapes
    from gpu_service.model.experts_api import Ready
    from gpu_service.plan.bytes import PRESETS_DIR

    with open(os.path.join(PRESETS_DIR, f"{preset}.json")) as f:
        d = json.load(f)
    d.pop("quantization_config", None)  # bf16 attention: the fp8/int8 linears are timed in linear_times
    d.update(num_hidden_layers=1, first_k_dense_replace=0, vocab_size=8192, **(overrides or {}))
    cfg = ModelConfig.from_dict(d, source=f"preset {preset}")
    g = torch.Generator().manual_seed(0)
    shapes, drawn = expected_shapes(cfg, routed=False), {}

    def get(name):  # drawn once, shared by every runner below
        if name not in drawn:
            shape = shapes[name]
            if name.endswith(("norm.weight", "layernorm.weight")):
                drawn[name] = np.ones(shape, np.float32)
            elif name.endswith("e_score_correction_bias"):
                drawn[name] = np.zeros(shape, np.float32)
            else:
                drawn[name] = (torch.randn(shape, generator=g) * 0.02).numpy()
        return drawn[name]

    reader = type("Reader", (), {"config": cfg, "get": staticmethod(get), "get_stored": staticmethod(lambda n: None)})
    zeros = lambda layer, h, ids, w: Ready(torch.zeros_like(h))  # noqa: E731 - routed experts not timed
    dev = torch.device(device)
    rows = []
    for B in batches:
        prompts = [[(31 * i + 7 * j + 1) % cfg.vocab_size for j in range(16)] for i in range(B)]
        got = {}
        for graphs in ((False, True) if dev.type == "cuda" else (False,)):
            r = ModelRunner(reader, zeros, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                            kv_tokens=64 * max(B, 4) * 2, cuda_graphs=graphs)
            toks, times = decode_batch(r, prompts, steps)
            got[graphs] = (toks, sorted(times[1:])[len(times[1:]) // 2] * 1e3)
            del r
        row = {"preset": preset, "batch": B, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
               "kv_lora_rank": cfg.kv_lora_rank, "ms_per_step_eager": round(got[False][1], 3)}
        if True in got:
            row.update(ms_per_step_graphs=round(got[True][1], 3), tokens_equal=got[True][0] == got[False][0])
        rows.append(row)
    return rows


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_batch(runner, prompts, steps):
    """Greedy decode of several sequences through ModelRunner.step: (tokens per step, seconds per
    step, synchronised on CUDA). Also used by tests/test_gpu.py."""
    from gpu_service.model.kv import Chunk

    seqs = [runner.new_seq() for _ in prompts]
    try:
        logits = runner.step(sum(prompts, []), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)])
        toks, times = [], []
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            toks.append(nxt)
            _sync(runner.device)
            t0 = time.perf_counter()
            logits = runner.step(nxt, [Chunk(s, s.length, 1) for s in seqs])
            _sync(runner.device)
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
        out["real_shapes_layer"] = real_shapes_layer("deepseek-v3")
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not all(r["tokens_equal"] for r in out.get("cuda_graphs_vs_eager", []) + out.get("real_shapes_layer", [])):
        print("bench_gpu: CUDA graphs changed the greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
