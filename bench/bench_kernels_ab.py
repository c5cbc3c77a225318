"""Paired before/after benchmark of the CPU kernels in one session: this tree's extension against another
build of it (an earlier commit's checkout built in place), each in a worker process, their calls interleaved.

Per ISA, every (build, format) engine holds the same E = 8 experts (DeepSeek-V3 shapes, top-8: a token
uses them all) and each round times one call of each, caches flushed before every call, in an order
that alternates between rounds; a shared machine's load then falls on both builds alike. Reported per
(ISA, format, tokens): each build's median wall and CPU time per call, its fraction of the read ceiling
(measured in the same process), after/before as the median of the per-round ratios (wall and CPU time),
and within each build the same-round ratios mxfp4 / int8 and each format / bf16.

    python bench/bench_kernels_ab.py --before /tmp/old-tree [--rounds 9] [--tokens 1] [--isa avx512,avx2] [--formats bf16,int8,int4,mxfp4] [--act-bits 16|8] [--topk 8] [--out kernels_ab.json]

--act-bits 8 runs the integer formats with 8-bit activations (expert-server --act-bits 8; bf16 has no
such mode and keeps 16); --topk K routes each token to K of the E = 8 experts (round-robin, so every
expert gets T*K/8 tokens, as a top-8-of-32 model's prefill gives each expert about T/4).
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a worker imports the kernels of the tree it serves (--tree), before bench_kernels binds this one's
TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else ROOT
sys.path.insert(0, TREE)
from cpu_expert_service import probes  # noqa: E402 (after the path)
from cpu_expert_service.kernels import _moe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as BK  # noqa: E402: the shapes, data and cache flush of the main bench

E_AB = 8


def engine(fmt: str, isa: str, act_bits: int = 16):
    """An Engine of this process's kernels holding E_AB experts of the main bench's data in `fmt` (integer
    formats with `act_bits` activations)."""
    cpus = sorted(os.sched_getaffinity(0))
    eng = _moe.Engine(fmt, isa, BK.THREADS, cpus, 0.0, act_bits if fmt != "bf16" else 16)
    if fmt == "mxfp4":
        base = BK.mxfp4_base()
        for e in range(E_AB):
            eng.add_mxfp4(0, e, BK.H, BK.I, *(np.ascontiguousarray(np.roll(a, 7 * e, axis=0)) for a in base))
    else:
        base = BK.base_weights()
        g, u, d = (np.empty(b.shape, np.float32) for b in base)
        for e in range(E_AB):
            BK.expert_weights_into(base, e, (g, u, d))
            eng.add_float(0, e, g, u, d)
    return eng


def inputs(T: int, topk: int = E_AB):
    """The call inputs of T tokens (the same in every process): token t on experts t*k .. t*k+k-1 mod E_AB
    (every token on all E_AB experts when topk = E_AB)."""
    rng = np.random.default_rng(1000 + T)
    x = rng.standard_normal((T, BK.H), dtype=np.float32)
    ids = (np.arange(T, dtype=np.int64)[:, None] * topk + np.arange(topk, dtype=np.int64)[None, :]) % E_AB
    return x, ids, rng.random((T, topk), dtype=np.float32)


def worker() -> int:
    """Serve one build: JSON commands on stdin (load ISA formats / call format T / free), answers on stdout."""
    engines: dict = {}
    for line in sys.stdin:
        q = json.loads(line)
        if q["cmd"] == "load":
            engines = {f: engine(f, q["isa"], q.get("act_bits", 16)) for f in q["formats"]}
            ans = {"bytes": {f: e.expert_bytes(0, 0) for f, e in engines.items()}}
        elif q["cmd"] == "call":
            x, ids, w = inputs(q["T"], q.get("topk", E_AB))
            if q.get("warm"):
                engines[q["fmt"]].forward(0, x, ids, w)
            BK.flush_caches()
            c, t = time.process_time(), time.perf_counter()
            engines[q["fmt"]].forward(0, x, ids, w)
            ans = {"ms": (time.perf_counter() - t) * 1e3, "cpu_ms": (time.process_time() - c) * 1e3}
        else:
            engines = {}
            gc.collect()
            ans = {}
        print(json.dumps(ans), flush=True)
    return 0


class Build:
    """A worker process running one tree's kernels."""

    def __init__(self, tree: str):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)

    def ask(self, **q) -> dict:
        self.p.stdin.write(json.dumps(q) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())


def bench_isa(isa: str, builds: dict, formats: list, tokens: list, rounds: int, read_gbps: float,
              act_bits: int = 16, topk: int = E_AB) -> tuple[list, list]:
    """Records and ratios of one ISA (see the module docstring)."""
    nbytes = {b: w.ask(cmd="load", isa=isa, formats=formats, act_bits=act_bits)["bytes"] for b, w in builds.items()}
    records, ratios = [], []
    for T in tokens:
        keys = [(b, f) for b in builds for f in formats]
        for b, f in keys:
            builds[b].ask(cmd="call", fmt=f, T=T, warm=True, topk=topk)
        got: dict = {k: [] for k in keys}
        for r in range(rounds):
            for b, f in (keys if r % 2 == 0 else keys[::-1]):
                a = builds[b].ask(cmd="call", fmt=f, T=T, topk=topk)
                got[(b, f)].append((a["ms"], a["cpu_ms"]))
        for (b, f), v in got.items():
            ms = statistics.median(a for a, _ in v)
            nb = E_AB * nbytes[b][f]
            records.append({"isa": isa, "build": b, "format": f, "tokens": T, "ms": round(ms, 3),
                            "act_bits": act_bits if f != "bf16" else 16, "topk": topk,
                            "cpu_ms": round(statistics.median(c for _, c in v), 3), "gbps": round(nb / ms / 1e6, 2),
                            "frac_of_read_bw": round(nb / ms / 1e6 / read_gbps, 3),
                            "bits_per_weight": round(8 * nb / E_AB / (3 * BK.H * BK.I), 3)})

        def med_ratio(num, den, i):
            return round(statistics.median(n[i] / d[i] for n, d in zip(got[num], got[den])), 3)
        for f in formats:
            if ("before", f) in got and ("after", f) in got:
                ratios.append({"isa": isa, "format": f, "tokens": T,
                               "after_ms_over_before_ms": med_ratio(("after", f), ("before", f), 0),
                               "after_cpu_over_before_cpu": med_ratio(("after", f), ("before", f), 1)})
            for b in builds:
                for base in ("bf16", "int8") if f == "mxfp4" else ("bf16",):
                    if base != f and (b, base) in got:
                        ratios.append({"isa": isa, "build": b, "format": f, "tokens": T,
                                       f"ms_over_{base}_ms": med_ratio((b, f), (b, base), 0),
                                       f"cpu_over_{base}_cpu": med_ratio((b, f), (b, base), 1)})
    for w in builds.values():
        w.ask(cmd="free")
    return records, ratios


def main() -> int:
    """Run the paired rounds, print and write the JSON (bench/results/)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the earlier tree (a checkout built in place: setup.py build_ext --inplace)")
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--isa", default="avx512,avx2")
    ap.add_argument("--formats", default=",".join(BK.FORMATS))
    ap.add_argument("--act-bits", type=int, choices=(16, 8), default=16,
                    help="the integer formats' activations (expert-server --act-bits)")
    ap.add_argument("--topk", type=int, default=E_AB, help=f"experts each token uses, of the {E_AB} held")
    ap.add_argument("--out", default="kernels_ab.json", help="file name under bench/results/")
    a = ap.parse_args()
    if a.worker:
        return worker()
    if not a.before:
        ap.error("--before TREE is required")
    builds = {"before": Build(a.before), "after": Build(ROOT)}
    t0 = time.time()
    read_gbps = probes.read_bandwidth_gbps(BK.THREADS)
    records, ratios = [], []
    for isa in a.isa.split(","):
        if not 1 <= a.topk <= E_AB:
            ap.error(f"--topk {a.topk}: between 1 and {E_AB}")
        rec, rat = bench_isa(isa, builds, a.formats.split(","), [int(t) for t in a.tokens.split(",")], a.rounds,
                             read_gbps, a.act_bits, a.topk)
        records += rec
        ratios += rat
        for q in rec + rat:
            print(q, flush=True)
    out = {"cpu": probes.cpu_vendor_family_model(), "threads": BK.THREADS, "experts": E_AB, "rounds": a.rounds,
           "act_bits": a.act_bits, "topk": a.topk,
           "read_gbps": round(read_gbps, 2), "before": a.before, "records": records, "ratios": ratios,
           "load_avg_1m_end": os.getloadavg()[0], "wall_s": round(time.time() - t0, 1),
           "notes": "medians over rounds; ratios are medians of per-round ratios (the calls of a round are adjacent in "
                    "time); cpu_ms = process CPU time of a call (both threads), robust to other processes' load"}
    path = os.path.join(BK.RESULTS, a.out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path} in {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
