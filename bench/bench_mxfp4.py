"""MXFP4 experts held as stored (e2m1 nibbles + e8m0 group scales) against the same experts held as
bf16, on DeepSeek-V4-Flash layer shapes, side by side in one run, with the read-bandwidth ceiling
probed in the same run.

H 4096, I 2048, E = 8 experts, top-6, 1 and 256 tokens per call, 2 threads (the kernels' pool),
caches flushed before every timed call (bench_kernels.timed). Both engines hold the same weights:
the bf16 one gets dequant_mxfp4 of the mxfp4 one's blocks (exact in bf16); an int4 engine (the
same panel layout and bytes, its own nibble code) re-quantises them, as the layout's reference speed. GB/s counts the packed
bytes of the experts a call touches once (what a weight stream must read). Writes
bench/results/mxfp4.json.

    python bench/bench_mxfp4.py [--threads N] [--tokens 1,256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_kernels as BK  # noqa: E402 (after the path): timed() + cache flush, one implementation
from checkpoint.formats_v4 import dequant_mxfp4  # noqa: E402
from cpu_expert_service import probes  # noqa: E402
from cpu_expert_service.kernel_backend import KernelExperts  # noqa: E402

H, I, E, TOPK = 4096, 2048, 8, 6
RESULTS = os.path.join(ROOT, "bench", "results")


def mxfp4_expert(rng):
    """Random stored MXFP4 tensors of one expert: (blocks, scales) for gate [I, H], up [I, H], down [H, I];
    scales near 2^-8 (e8m0 119..121) like a trained model's."""
    out = []
    for o, i in ((I, H), (I, H), (H, I)):
        out.append(rng.integers(0, 256, size=(o, i // 2), dtype=np.uint8))
        out.append(rng.integers(119, 122, size=(o, i // 32), dtype=np.uint8))
    return out


def build(threads: int):
    """The engines holding the same E experts (layer 0): mxfp4 as stored, bf16 exact, int4 re-quantised."""
    rng = np.random.default_rng(0)
    engines = {fmt: KernelExperts(fmt, num_threads=threads) for fmt in ("mxfp4", "bf16", "int4")}
    for e in range(E):
        st = mxfp4_expert(rng)
        engines["mxfp4"].add_expert_mxfp4(0, e, *st)
        deq = [dequant_mxfp4(st[2 * j], st[2 * j + 1]) for j in range(3)]
        engines["bf16"].add_expert(0, e, *deq)
        engines["int4"].add_expert(0, e, *deq)
    for be in engines.values():
        be.finalize()
    return engines


def routing(T: int, seed: int):
    """Top-6 of 8 per token, softmax-like weights."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(T)]).astype(np.int64)
    return ids, rng.random((T, TOPK), dtype=np.float32) / TOPK


def run(threads: int, tokens: list[int]) -> dict:
    """Ceiling, then each (tokens, format) call timed; returns the record."""
    read_gbps = probes.read_bandwidth_gbps(threads)
    engines = build(threads)
    records = []
    for T in tokens:
        x = np.random.default_rng(T).standard_normal((T, H), dtype=np.float32)
        ids, w = routing(T, T)
        used = sorted(set(ids.reshape(-1).tolist()))
        for fmt, be in engines.items():
            touched = sum(be.expert_bytes(0, e) for e in used)
            ms, cpu = BK.timed(lambda: be.forward(0, x, ids, w), 20 if T == 1 else 3)
            gbps = touched / (ms * 1e-3) / 1e9
            records.append({"format": fmt, "isa": be.isa, "tokens": T, "experts_touched": len(used),
                            "bytes_touched": touched, "ms": round(ms, 3), "gbps": round(gbps, 2),
                            "gflops": round(2.0 * 3 * H * I * T * TOPK / (ms * 1e-3) / 1e9, 2),
                            "cpu_util": round(cpu, 2), "of_read_ceiling": round(gbps / read_gbps, 3)})
            print(f"{fmt:6s} T={T:4d}  {ms:9.3f} ms  {gbps:7.2f} GB/s ({gbps / read_gbps:5.1%} of read)  "
                  f"{records[-1]['gflops']:8.2f} GFLOP/s", flush=True)
    by = {(r["format"], r["tokens"]): r for r in records}
    ratios = {f"T={T}": {"bf16_ms_over_mxfp4_ms": round(by["bf16", T]["ms"] / by["mxfp4", T]["ms"], 3),
                         "bytes_ratio": round(by["bf16", T]["bytes_touched"] / by["mxfp4", T]["bytes_touched"], 3)}
              for T in tokens}
    for k, v in ratios.items():
        print(f"{k}: mxfp4 is {v['bf16_ms_over_mxfp4_ms']}x faster than bf16 on {v['bytes_ratio']}x fewer bytes")
    return {"shapes": {"H": H, "I": I, "E": E, "topk": TOPK}, "threads": threads,
            "cpu": probes.cpu_vendor_family_model(), "read_gbps": round(read_gbps, 2),
            "records": records, "ratios": ratios}


def main() -> int:
    """Parse, run, write bench/results/mxfp4.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,256", help="comma-separated token counts per call")
    a = ap.parse_args()
    res = run(a.threads, [int(t) for t in a.tokens.split(",")])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "mxfp4.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"read ceiling {res['read_gbps']} GB/s; wrote {os.path.join(RESULTS, 'mxfp4.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
