"""`moesplit doctor` against `make bench-kernels`' ceilings, and `moesplit bench` on a tiny checkpoint.

Part 1: `moesplit doctor --json --threads 2` and `bench/bench_kernels.py --ceilings-only` (the ceilings
`make bench-kernels` records), run back to back as separate processes for --rounds rounds in one
session (which goes first alternates); per figure (read bandwidth, each dot peak) each round's
doctor / bench-kernels ratio, their median, and whether that is within 10%. Both run cpu_expert_service.probes, so a
difference is the machine's run-to-run spread (other processes on shared cores), not the code.

Part 2: `moesplit bench` on a tiny bf16 checkpoint (gpu_service.local.tiny.make_tiny, 2 shards,
1 and 32 streams): measured and predicted decode tokens/s and their ratio.

Writes bench/results/doctor.json.

    python bench/bench_doctor.py [--rounds 3] [--max-tokens 32] [--skip-bench] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
ENV = dict(os.environ, PYTHONPATH=ROOT)
BENCH_THREADS = 2  # bench/bench_kernels.py's THREADS
KEYS = ("read_gbps", "peak_fma_f32_gflops", "peak_dpbf16_gflops", "peak_vnni_int8_gops", "peak_fma_f32_avx2_gflops",
        "peak_maddubs_int8_avx2_gops")


def _json_of(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def compare(rounds: int) -> dict:
    """Doctor and bench-kernels' ceilings, alternating, per figure: medians, ratio, within 10%."""
    # bench-kernels probes with its THREADS (2); the doctor with one per allowed CPU unless told: the same here
    doc_cmd = [sys.executable, "-m", "moesplit", "doctor", "--json", "--no-gpu-probe", "--threads", str(BENCH_THREADS)]
    bk_cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_kernels.py"), "--ceilings-only"]
    doc, bk, isas = [], [], set()
    for r in range(rounds):
        for which in (("doctor", "bench") if r % 2 == 0 else ("bench", "doctor")):
            if which == "doctor":
                rep = _json_of(doc_cmd)
                isas.add(rep["cpu"]["kernel_isa"])
                doc.append(rep["cpu"]["ceilings"])
            else:
                bk.append(_json_of(bk_cmd))
            print(f"round {r + 1}/{rounds} {which}: read {(doc if which == 'doctor' else bk)[-1]['read_gbps']} GB/s",
                  flush=True)
    return {"kernel_isa": sorted(isas), "figures": summarize(doc, bk)}


def summarize(doc: list[dict], bk: list[dict]) -> dict:
    """Per figure: each round's doctor / bench-kernels ratio (the two ran back to back, so a change
    of the machine's load between rounds cancels) and their median, the headline; the medians of
    each side's runs and their spread beside it."""
    out = {}
    for k in KEYS:
        pairs = [(d[k], b[k]) for d, b in zip(doc, bk) if d.get(k) is not None and b.get(k) is not None]
        if not pairs:
            continue
        ratios = [d / b for d, b in pairs]
        d, b = [p[0] for p in pairs], [p[1] for p in pairs]
        out[k] = {"paired_ratio_median": round(_median(ratios), 3), "within_10pct": abs(_median(ratios) - 1) <= 0.10,
                  "paired_ratios": [round(r, 3) for r in ratios],
                  "doctor_median": round(_median(d), 2), "bench_kernels_median": round(_median(b), 2),
                  "doctor_runs": d, "bench_kernels_runs": b,
                  "spread_bench_kernels": round(max(b) / min(b), 2), "spread_doctor": round(max(d) / min(d), 2)}
    return out


def bench_tiny(max_tokens: int) -> dict:
    """`moesplit bench` on a fresh tiny bf16 checkpoint: its JSON."""
    sys.path.insert(0, ROOT)
    from gpu_service.local.tiny import make_tiny

    d = os.path.join(tempfile.mkdtemp(prefix="moesplit-bench-doctor-"), "tiny")
    make_tiny(d, "bf16", seed=0)
    out = os.path.join(os.path.dirname(d), "bench.json")
    subprocess.run([sys.executable, "-m", "moesplit", "bench", "--model", d, "--streams", "1,32", "--max-tokens",
                    str(max_tokens), "--rounds", "3", "--out", out], check=True, cwd=ROOT, env=ENV, timeout=1800)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-bench", action="store_true", help="part 1 only")
    ap.add_argument("--out", default=os.path.join(RESULTS, "doctor.json"))
    args = ap.parse_args()
    t0 = time.time()
    res = {"definition": __doc__, "loadavg_at_start": os.getloadavg(), "doctor_vs_bench_kernels": compare(args.rounds)}
    for k, v in res["doctor_vs_bench_kernels"]["figures"].items():
        print(f"{k:28s} doctor / bench-kernels, median of rounds {v['paired_ratio_median']:.3f} "
              f"({'within' if v['within_10pct'] else 'OUTSIDE'} 10%; rounds {v['paired_ratios']})  medians "
              f"{v['doctor_median']:.2f} / {v['bench_kernels_median']:.2f}  "
              f"(spread across runs: bench-kernels {v['spread_bench_kernels']}x, doctor {v['spread_doctor']}x)")
    if not args.skip_bench:
        b = bench_tiny(args.max_tokens)
        res["bench_tiny"] = {"results": b["results"], "cpu_model": b["cpu_model"], "kernel_isa": b["kernel_isa"],
                             "prediction_inputs": b["prediction"]["inputs"], "prediction_sides": b["prediction"]["sides"]}
        for s, r in b["results"].items():
            print(f"bench tiny, {s} streams: measured {r['tokens_per_s']} tok/s, predicted "
                  f"{r['predicted_tokens_per_s']}, measured/predicted {r['measured_over_predicted']}")
    res["loadavg_at_end"] = os.getloadavg()
    res["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} in {res['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
