"""Benchmark the CPU MoE kernels on DeepSeek-V3 layer shapes against this machine's ceilings
and, where it installs, kt-kernel's MoE op on identical data.

H 7168, I 2048, E = 32 experts, top-8, 1 / 8 / 64 / 256 tokens per call, bf16 / int8 / int4 / mxfp4,
2 threads, on every kernel ISA this machine runs (--isa picks some); each record keeps its fraction of
the read ceiling and of the dot peak of the instruction it runs on, and the swiglu_limit (DeepSeek-V4's
clamp) cost is measured as paired records with and without the clamp; the caches are flushed before every timed call (decode streams weights from memory). Writes bench/results/kernels.json (records + ceilings + kt-kernel status/ratios) and
bench/results/kernels.png. kt-kernel is looked for in a separate venv ($KT_KERNEL_VENV, default
/tmp/ktvenv, made with `pip install --no-deps kt-kernel`) and run in a subprocess per format, so
its worker threads never overlap our measurements.

    python bench/bench_kernels.py [--no-kt] [--ceilings-only] [--isa avx512,avx2] [--formats int8,int4]
                                  [--tokens 1,256] [--swiglu-limit 10] [--out kernels.json]

The ceilings come from cpu_expert_service.probes, the probes `moesplit doctor` runs.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpu_expert_service import probes  # noqa: E402 (after the path): the ceilings' one implementation

H, I, E, TOPK = 7168, 2048, 32, 8
TOKENS = (1, 8, 64, 256)
FORMATS = ("bf16", "int8", "int4", "mxfp4")
SWIGLU_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit; the clamp-cost records use it
THREADS = 2
RESULTS = os.path.join(ROOT, "bench", "results")
KT_METHOD = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}


# ----------------------------------------------------------------------------- shared data
def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def base_weights(seed: int = 0):
    """Three random bf16 matrices; expert e is these rolled by e * 7919 (distinct memory, cheap)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s, dtype=np.float32) * 0.02).astype(bf16()) for s in ((I, H), (I, H), (H, I))]


def expert_weights_into(base, e: int, out) -> None:
    """out[i] = base[i] rolled by e * 7919 (flat), cast to out's dtype; no new allocations (fresh
    pages are slow to fault in on this VM)."""
    for src, dst in zip(base, out):
        sf, df, n = src.reshape(-1), dst.reshape(-1), src.size
        s = (e * 7919) % n
        df[s:] = sf[: n - s]
        df[:s] = sf[n - s:]


def mxfp4_base(seed: int = 0):
    """Random stored MXFP4 tensors (blocks [out, in/2] u8, e8m0 scales [out, in/32] near 2^-8, like a
    trained model's) for gate [I, H], up [I, H], down [H, I]; expert e rolls their rows by 7 * e."""
    rng = np.random.default_rng(seed)
    out = []
    for o, i in ((I, H), (I, H), (H, I)):
        out += [rng.integers(0, 256, size=(o, i // 2), dtype=np.uint8), rng.integers(119, 122, size=(o, i // 32), dtype=np.uint8)]
    return out


def routing(T: int, seed: int):
    rng = np.random.default_rng(1000 + seed)
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, TOPK), dtype=np.float32)
    return x, ids, w


def reps_for(T: int) -> int:
    return 5 if T <= 8 else 2


_FLUSH: list = []


def flush_caches() -> None:
    """Read a buffer of twice the last-level cache (at least 512 MiB) so the next call finds no
    weights in any cache, as in decode, where each layer's experts are new: a repeated call would
    otherwise find its experts in L3 when they fit (8 int4 experts are 176 MB, this VM's L3 260 MB)."""
    if not _FLUSH:
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE") if "SC_LEVEL3_CACHE_SIZE" in os.sysconf_names else 0
        _FLUSH.append(np.ones(max(2 * max(l3, 0), 512 << 20) // 8, dtype=np.uint64))
    _FLUSH[0].max()


def timed(fn, reps: int):
    fn()  # warm-up
    ms, cpu = [], []
    for _ in range(reps):
        flush_caches()  # every timed call streams its weights from memory
        c, t = time.process_time(), time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        ms.append(dt * 1e3)
        cpu.append((time.process_time() - c) / dt)
    return float(np.median(ms)), float(np.median(cpu))


def record(impl, fmt, T, ms, cpu, touched_bytes, extra=None):
    flops = 2.0 * 3 * H * I * T * TOPK
    r = {"impl": impl, "format": fmt, "tokens": T, "ms": round(ms, 3),
         "gbps": round(touched_bytes / (ms * 1e-3) / 1e9, 2), "gflops": round(flops / (ms * 1e-3) / 1e9, 2),
         "cpu_util": round(cpu, 2),
         # per CPU-second of this process: what the kernels do on the core time they actually got
         "gbps_per_core": round(touched_bytes / (ms * 1e-3 * max(cpu, 1e-3)) / 1e9, 2),
         "gflops_per_core": round(flops / (ms * 1e-3 * max(cpu, 1e-3)) / 1e9, 2)}
    r.update(extra or {})
    return r


# ----------------------------------------------------------------------------- ceilings
def read_bandwidth_numpy_gbps(threads: int = THREADS) -> float:
    """The old ceiling, for comparison: numpy over 2 GiB (float32 sum on one thread, uint64 max
    over `threads` parts on threads), best of 3. It understates the machine (numpy's loops are
    not a streaming kernel): the bf16 decode once measured above it."""
    import threading

    buf = np.ones(2 << 30 >> 2, dtype=np.float32)  # 2 GiB
    parts = np.array_split(buf.view(np.uint64), threads)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - t) / 1e9)
        ths = [threading.Thread(target=part.max) for part in parts]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t) / 1e9)
    del buf, parts
    return best


def torch_bf16_gflops(budget_s: float = 20.0) -> tuple[float | None, int]:
    """torch's bf16 GEMM [M, H] x [H, 2I] on THREADS threads, M = 256 unless that would take more
    than `budget_s` (torch's bf16 matmul without native bf16 instructions runs at ~0.2 GFLOP/s,
    and 256 rows would take minutes): then M = 16. Returns (GFLOP/s, M)."""
    try:
        import torch
    except ImportError:
        return None, 0
    torch.set_num_threads(THREADS)
    b = torch.randn(H, 2 * I, dtype=torch.bfloat16)
    a = torch.randn(16, H, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    a @ b
    small_s = time.perf_counter() - t
    m = 256 if small_s * 16 * 4 < budget_s else 16
    a = torch.randn(m, H, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    n = 3
    for _ in range(n):
        a @ b
    return 2.0 * m * H * 2 * I * n / (time.perf_counter() - t) / 1e9, m


def peaks_per_cpu_second(iters: int = 2 * 10**7, passes: int = 3) -> dict:
    """Each dot-peak probe on this one thread per CPU-second (probes.probe_gops_per_cpu_second):
    a shared machine's other load cancels in the ratio against a record's *_per_core figure. Keys
    as the ceilings', in G ops per CPU-second."""
    out = {}
    for kind, (key, _) in probes.PROBES.items():
        g = probes.probe_gops_per_cpu_second(kind, iters, passes)
        if g is not None:
            out[key] = round(g, 1)
    for kind in sorted({k for kinds in probes.REPRESENTATION_CEILINGS.values() for k in kinds}):
        g = probes.probe_gops_per_cpu_second(kind, iters, passes)
        if g is not None:
            out[kind] = round(g, 1)
    return out


def ceiling_probe(r: dict, per_cpu: dict, key: str) -> dict | None:
    """A record's representation ceiling (probes.REPRESENTATION_CEILINGS: the best of its exact minimal
    loops, per CPU-second) beside the instruction's peak `key`: what the kernel could reach at most."""
    kinds = probes.REPRESENTATION_CEILINGS.get((r.get("isa"), r["format"], r.get("act_bits") or 16))
    got = {k: per_cpu[k] for k in kinds or () if per_cpu.get(k)}
    if not got or not per_cpu.get(key):
        return None
    best = max(got, key=got.get)
    return {"name": best, "gops_per_cpu_s": got[best], "frac_of_peak": round(got[best] / per_cpu[key], 3),
            "record_frac_of_ceiling": round(r["gflops_per_core"] / got[best], 3), "probes": got}


def add_fractions(records: list, ceilings: dict) -> None:
    """Each of our records' fraction of its ceiling: the probed read bandwidth (what bounds the
    1-token stream) and the probed peak of the instruction its GEMM runs on (what bounds prefill),
    by wall clock, and per CPU-second (the record's *_per_core over the one-thread CPU-time peak)."""
    from cpu_expert_service.kernels import _moe

    form = _moe.bf16_dot_form()
    per_cpu = ceilings.get("peaks_per_cpu_second") or {}
    for r in records:
        if r["impl"] != "moesplit":
            continue
        r["frac_of_read_bw"] = round(r["gbps"] / ceilings["read_gbps"], 3)
        key = probes.compute_ceiling_key(r.get("isa"), r["format"], form)
        if key and ceilings.get(key):
            r["compute_ceiling"] = key
            r["frac_of_compute_peak"] = round(r["gflops"] / ceilings[key], 3)
        if key and per_cpu.get(key):
            r["frac_of_compute_peak_per_cpu_s"] = round(r["gflops_per_core"] / per_cpu[key], 3)
            cp = ceiling_probe(r, per_cpu, key)
            if cp:
                r["ceiling_probe"] = cp


def same_isa_ratios(records: list) -> list:
    """Per (ISA, tokens), within this run: each format's time over bf16's (< 1: faster than bf16), mxfp4's
    over int8's (same activation width), 8-bit activations' over 16-bit, and the swiglu_limit clamp's
    time over the same call without it."""
    ours = {(r.get("isa"), r["format"], r["tokens"], bool(r.get("swiglu_limit")), r.get("act_bits")): r["ms"]
            for r in records if r["impl"] == "moesplit"}
    out = []
    for (isa, fmt, T, clamp, ab), ms in sorted(ours.items(), key=str):
        row = {"isa": isa, "format": fmt, "tokens": T, "act_bits": ab}
        if clamp:
            base = ours.get((isa, fmt, T, False, ab))
            if base:
                out.append(dict(row, clamp_ms_over_plain_ms=round(ms / base, 3)))
            continue
        bf = ours.get((isa, "bf16", T, False, None))
        if bf and fmt != "bf16":
            out.append(dict(row, ms_over_bf16_ms=round(ms / bf, 3)))
        i8 = ours.get((isa, "int8", T, False, ab))
        if i8 and fmt == "mxfp4":
            out.append(dict(row, ms_over_int8_ms=round(ms / i8, 3)))
        a16 = ours.get((isa, fmt, T, False, 16))
        if a16 and ab == 8:
            out.append(dict(row, ms_over_act16_ms=round(ms / a16, 3)))
    return out


# ----------------------------------------------------------------------------- ours
def load_ours(fmt: str, isa: str | None, swiglu_limit: float | None = None, act_bits: int = 16):
    """A KernelExperts on `isa` holding the E experts in `fmt` (mxfp4 as stored, others from floats)
    with `act_bits` activations; returns (backend, pack seconds)."""
    from cpu_expert_service.kernel_backend import KernelExperts

    extra = {"act_bits": act_bits} if act_bits != 16 else {}  # (a tree without the option still benches)
    be = KernelExperts(fmt, num_threads=THREADS, isa=isa, swiglu_limit=swiglu_limit, **extra)
    t = time.perf_counter()
    if fmt == "mxfp4":
        base = mxfp4_base()
        for e in range(E):
            be.add_expert_mxfp4(0, e, *(np.roll(a, 7 * e, axis=0) for a in base))
    else:
        base = base_weights()
        g, u, d = (np.empty(b.shape, np.float32) for b in base)
        for e in range(E):
            expert_weights_into(base, e, (g, u, d))
            be.add_expert(0, e, g, u, d)
        del g, u, d
    be.finalize()
    pack_s = time.perf_counter() - t
    del base
    gc.collect()
    return be, pack_s


def bench_ours(fmt: str, isa: str | None = None, tokens=TOKENS, swiglu_limit: float | None = None,
               act_bits=(16,)):
    """Time our op on `isa` for each token count; with swiglu_limit, the same calls again on a second
    engine holding the same experts with the clamp on, and for an integer format each of `act_bits`
    beyond 16 on an engine of its own, interleaved per token count (paired ratios)."""
    be, pack_s = load_ours(fmt, isa)
    engines = [(be, None, 16)]
    if swiglu_limit:
        engines.append((load_ours(fmt, isa, swiglu_limit)[0], swiglu_limit, 16))
    if fmt != "bf16":
        engines += [(load_ours(fmt, isa, act_bits=a)[0], None, a) for a in act_bits if a != 16]
    ebytes = be.expert_bytes(0, 0)
    out = []
    for T in tokens:
        x, ids, w = routing(T, T)
        for eng, lim, abits in engines:
            ms, cpu = timed(lambda: eng.forward(0, x, ids, w), reps_for(T))
            out.append(record("moesplit", fmt, T, ms, cpu, len(np.unique(ids)) * ebytes,
                              {"isa": eng.isa, "swiglu_limit": lim, "act_bits": abits if fmt != "bf16" else None,
                               "bits_per_weight": round(8 * ebytes / (3 * H * I), 3)}))  # what a decode reads
            tag = "clamp" if lim else f"a{abits}" if fmt != "bf16" else ""
            print(f"  moesplit  {eng.isa:6s} {fmt:5s} {tag:5s} T={T:4d} {ms:9.2f} ms  {out[-1]['gbps']:7.2f} GB/s  "
                  f"{out[-1]['gflops']:7.1f} GFLOP/s  cpu {cpu:.2f}", flush=True)
    name = be.name
    del be, engines
    gc.collect()
    return out, {"name": name, "pack_s_per_expert": round(pack_s / E, 3), "expert_bytes": ebytes}


# ----------------------------------------------------------------------------- kt-kernel
def kt_extension_path() -> str | None:
    venv = os.environ.get("KT_KERNEL_VENV", "/tmp/ktvenv")
    hits = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "kt_kernel", "_kt_kernel_ext_avx512_bf16*.so"))
    return hits[0] if hits else None


def kt_worker(fmt: str, so_path: str) -> None:
    """Runs in a subprocess: load kt-kernel's extension (no torch needed), same data, print JSON."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kt_kernel_ext", so_path)
    k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k)
    wc = k.WorkerPoolConfig()
    wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [THREADS]
    cpu = k.CPUInfer(wc)
    base = base_weights()
    g = np.empty((E, I, H), dtype=bf16())  # gate [E, I, H]
    u = np.empty((E, I, H), dtype=bf16())
    d = np.empty((E, H, I), dtype=bf16())  # down [E, H, I]
    for e in range(E):
        expert_weights_into(base, e, (g[e], u[e], d[e]))
    del base
    mask = np.zeros(E, dtype=np.bool_)
    cfg = k.moe.MOEConfig(E, TOPK, H, I, mask.ctypes.data)
    cfg.layer_idx, cfg.pool, cfg.max_len = 0, cpu.backend_, max(TOKENS)
    if fmt == "bf16":
        cfg.gate_projs = [[g[e].ctypes.data for e in range(E)]]
        cfg.up_projs = [[u[e].ctypes.data for e in range(E)]]
        cfg.down_projs = [[d[e].ctypes.data for e in range(E)]]
        cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * E]
    else:  # online quantisation from the bf16 tensors, in memory
        cfg.save, cfg.load = False, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = g.ctypes.data, u.ctypes.data, d.ctypes.data
        cfg.path = "/tmp/kt_bench_unused"
    moe = getattr(k.moe, KT_METHOD[fmt])(cfg)
    p2l = np.arange(E, dtype=np.int64)
    cpu.submit(moe.load_weights_task(p2l.ctypes.data))
    cpu.sync()
    if fmt != "bf16":
        del g, u, d  # quantised copies are kt's own
        gc.collect()
    ebytes = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}[fmt] * 3 * H * I
    out = []
    for T in TOKENS:
        x, ids, w = routing(T, T)
        xb = x.astype(bf16())
        o = np.zeros((T, H), dtype=bf16())
        bsz = np.array([T], dtype=np.int32)

        def run():
            cpu.submit(moe.forward_task(bsz.ctypes.data, TOPK, ids.ctypes.data, w.ctypes.data, xb.ctypes.data,
                                        o.ctypes.data, False))
            cpu.sync()

        ms, cpu_u = timed(run, reps_for(T))
        out.append(record("kt-kernel", fmt, T, ms, cpu_u, len(np.unique(ids)) * ebytes,
                          {"kt_class": KT_METHOD[fmt], "kt_variant": getattr(k, "__cpu_variant__", "?")}))
    print("KTJSON " + json.dumps(out), flush=True)


def bench_kt(fmt: str, so_path: str, timeout_s: float):
    cmd = [sys.executable, os.path.abspath(__file__), "--kt-worker", fmt, "--kt-so", so_path]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    for line in r.stdout.splitlines():
        if line.startswith("KTJSON "):
            recs = json.loads(line[len("KTJSON "):])
            for rec in recs:
                print(f"  kt-kernel {fmt:5s} T={rec['tokens']:4d} {rec['ms']:9.2f} ms  {rec['gbps']:7.2f} GB/s  "
                      f"{rec['gflops']:7.1f} GFLOP/s  cpu {rec['cpu_util']:.2f}", flush=True)
            return recs, None
    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
    return [], f"kt-kernel {fmt} run failed (rc {r.returncode}): {' | '.join(tail)}"


# ----------------------------------------------------------------------------- plot
def plot(records, ceilings, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FORMATS), figsize=(5 * len(FORMATS), 4.5), sharey=True)
    isas = sorted({r.get("isa") for r in records if r["impl"] == "moesplit"}, key=str)
    for ax, fmt in zip(axes, FORMATS):
        ours = [r for r in records if r["impl"] == "moesplit" and r["format"] == fmt and not r.get("swiglu_limit")]
        for isa, style in zip(isas, ("o-", "^-", "v-", "d-")):
            rs = sorted((r for r in ours if r.get("isa") == isa), key=lambda r: r["tokens"])
            if rs:
                ax.plot([r["tokens"] for r in rs], [r["ms"] for r in rs], style, label=f"moesplit {isa}")
        rs = sorted((r for r in records if r["impl"] == "kt-kernel" and r["format"] == fmt), key=lambda r: r["tokens"])
        if rs:
            ax.plot([r["tokens"] for r in rs], [r["ms"] for r in rs], "s--", label="kt-kernel")
        rs = sorted((r for r in ours if r.get("isa") == isas[0]), key=lambda r: r["tokens"]) if isas else []
        if rs:
            toks = [r["tokens"] for r in rs]
            touched = [r["gbps"] * r["ms"] * 1e-3 * 1e9 for r in rs]  # bytes
            ax.plot(toks, [b / (ceilings["read_gbps"] * 1e9) * 1e3 for b in touched], ":", color="gray",
                    label=f"read-bandwidth floor ({ceilings['read_gbps']:.1f} GB/s)")
            fl = [2.0 * 3 * H * I * t * TOPK for t in toks]
            for key, style, color in (("torch_bf16_gflops", "-.", "gray"),
                                      (rs[0].get("compute_ceiling"), "--", "tan")):
                if key and ceilings.get(key):
                    ax.plot(toks, [f / (ceilings[key] * 1e9) * 1e3 for f in fl], style, color=color,
                            label=f"{key} ({ceilings[key]:.0f})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{fmt}: H={H} I={I} E={E} top-{TOPK}, {THREADS} threads")
        ax.set_xlabel("tokens per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per call")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kt-worker", help=argparse.SUPPRESS)
    ap.add_argument("--kt-so", help=argparse.SUPPRESS)
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel")
    ap.add_argument("--isa", help="comma-separated kernel ISAs to measure (default: every one this machine runs "
                    "except generic)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated tokens per call")
    ap.add_argument("--swiglu-limit", type=float, default=SWIGLU_LIMIT,
                    help="clamp of the paired clamp-cost records (0: none)")
    ap.add_argument("--act-bits", default="16,8", help="integer formats' activation widths to measure (16 = default)")
    ap.add_argument("--out", default="kernels.json", help="file name under bench/results/")
    ap.add_argument("--ceilings-only", action="store_true",
                    help="print the probed ceilings (read bandwidth, dot peaks; what `moesplit doctor` reports) "
                         "as JSON and stop")
    args = ap.parse_args()
    if args.kt_worker:
        kt_worker(args.kt_worker, args.kt_so)
        return 0
    if args.ceilings_only:
        print(json.dumps(probes.measure(THREADS)["ceilings"]))
        return 0

    os.makedirs(RESULTS, exist_ok=True)
    from cpu_expert_service.kernel_backend import AVAILABLE_ISAS
    from cpu_expert_service.kernels import _moe

    isas = args.isa.split(",") if args.isa else [i for i in AVAILABLE_ISAS if i != "generic"]
    formats, tokens = args.formats.split(","), tuple(int(t) for t in args.tokens.split(","))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"--formats: {unknown} not among {FORMATS}")

    print(f"bf16 form of the AVX-512 kernels here: {_moe.bf16_dot_form()}", flush=True)
    t0 = time.time()
    host = probes.measure(THREADS)  # the probes `moesplit doctor` runs: one implementation
    ceilings = dict(host["ceilings"], read_gbps_numpy=round(read_bandwidth_numpy_gbps(), 2))
    tg, tm = torch_bf16_gflops()
    ceilings["torch_bf16_gflops"] = round(tg, 1) if tg else None
    ceilings["torch_bf16_gflops_method"] = f"torch bf16 [{tm},{H}]x[{H},{2 * I}] matmul, {THREADS} threads"
    ceilings["peaks_per_cpu_second"] = peaks_per_cpu_second()
    print(f"ceilings: {ceilings}", flush=True)

    so = None if args.no_kt else kt_extension_path()
    kt_status = "skipped (--no-kt)" if args.no_kt else ("ok" if so else
                "unavailable: no kt-kernel venv with _kt_kernel_ext_avx512_bf16 at $KT_KERNEL_VENV (default /tmp/ktvenv); "
                "create it with `python3 -m venv /tmp/ktvenv && /tmp/ktvenv/bin/pip install --no-deps kt-kernel`")
    records, ours_info, kt_errors = [], {}, []
    for fmt in formats:
        for isa in isas:
            recs, info = bench_ours(fmt, isa, tokens, args.swiglu_limit or None,
                                    tuple(int(a) for a in args.act_bits.split(",")))
            records += recs
            ours_info[f"{isa}/{fmt}"] = info
        if so and fmt in KT_METHOD:
            try:
                recs, err = bench_kt(fmt, so, timeout_s=150)
            except subprocess.TimeoutExpired:
                recs, err = [], f"kt-kernel {fmt}: timed out"
            records += recs
            if err:
                kt_errors.append(err)
    if so and kt_errors:
        kt_status = "partial: " + "; ".join(kt_errors)

    ratios = []
    for r in records:
        if r["impl"] != "moesplit":
            continue
        kt = next((q for q in records if q["impl"] == "kt-kernel" and q["format"] == r["format"]
                   and q["tokens"] == r["tokens"]), None)
        if kt and not r.get("swiglu_limit"):
            ratios.append({"isa": r.get("isa"), "format": r["format"], "tokens": r["tokens"],
                           "speedup_vs_kt": round(kt["ms"] / r["ms"], 2)})
    add_fractions(records, ceilings)
    same_isa = same_isa_ratios(records)
    result = {
        "shape": {"H": H, "I": I, "experts": E, "top_k": TOPK, "threads": THREADS},
        "host": {k: v for k, v in host.items() if k != "ceilings"},
        "ceilings": ceilings,
        "records": records,
        "kt_kernel": kt_status,
        "kt_kernel_notes": ("kt-kernel 0.7.2 _kt_kernel_ext_avx512_bf16 (no AMX here, so its AMX* classes run "
                            "their AVX-512 paths); INT8/INT4 quantised online from the same bf16 weights by kt "
                            "(AMXInt4_MOE is kt's own int4 layout, not compressed-tensors group-32); its output "
                            "is bf16, ours f32."),
        "ratios": ratios,
        "same_isa_ratios": same_isa,
        "cpu": probes.cpu_vendor_family_model(),
        "ours": ours_info,
        "bf16_form_avx512": _moe.bf16_dot_form(),
        "notes": ("cpu_util = process CPU seconds / wall seconds during a call (2.0 = both cores ours); the "
                  "machine is shared, so lower values mean other processes held the cores. *_per_core divide by "
                  "CPU seconds instead of wall seconds. Our pool sleeps when idle (no spinning), so under "
                  "contention it yields cores that a spinning pool (kt-kernel shows cpu_util ~2.0) keeps."),
        "wall_s": round(time.time() - t0, 1),
    }
    out = os.path.join(RESULTS, args.out)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(records, ceilings, os.path.splitext(out)[0] + ".png")
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print(f"plot failed: {e}")
    for q in same_isa:
        print(f"  {q}")
    print(f"wrote {out} (+ .png) in {result['wall_s']} s; kt-kernel: {kt_status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
