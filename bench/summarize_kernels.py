"""Median-of-runs table of bench_kernels.py results: before (another tree's runs) and after, per ISA,
format, activation width, clamp and token count, with each record's fraction of its ceilings and the
same-run ratios (int formats over bf16, a8 over a16, the clamp's cost), medians over the runs.

    python bench/summarize_kernels.py --after bench/results/kernels_r{1,2,3}.json \
        [--before /path/before_r{1,2,3}.json] [--out bench/results/kernels_round3_summary.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def key(r: dict) -> tuple:
    """A record's identity across runs."""
    return (r.get("isa"), r["format"], r.get("act_bits") or (16 if r["format"] != "bf16" else None),
            bool(r.get("swiglu_limit")), r["tokens"])


FIELDS = ("ms", "gbps", "gflops", "gflops_per_core", "cpu_util", "frac_of_read_bw", "frac_of_compute_peak",
          "frac_of_compute_peak_per_cpu_s")


def medians(paths: list[str]) -> tuple[dict, dict, list]:
    """(key -> {field: median}, ceiling -> median, the runs' CPU names) over the result files."""
    runs = [json.load(open(p)) for p in paths]
    by: dict = {}
    for run in runs:
        for r in run["records"]:
            if r["impl"] == "moesplit":
                by.setdefault(key(r), []).append(r)
    rows = {k: {f: round(statistics.median(r[f] for r in rs if r.get(f) is not None), 3)
                for f in FIELDS if any(r.get(f) is not None for r in rs)} | {"runs": len(rs)}
            for k, rs in by.items()}
    ceil: dict = {}
    for run in runs:
        for name, v in run["ceilings"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                ceil.setdefault(name, []).append(v)
            elif isinstance(v, dict):
                for n2, v2 in v.items():
                    if isinstance(v2, (int, float)):
                        ceil.setdefault(f"{name}.{n2}", []).append(v2)
    return rows, {k: round(statistics.median(v), 2) for k, v in ceil.items()}, [run.get("cpu") for run in runs]


def ratio_medians(paths: list[str]) -> dict:
    """Same-run ratios (bench_kernels.same_isa_ratios), median over runs."""
    acc: dict = {}
    for p in paths:
        for q in json.load(open(p)).get("same_isa_ratios", []):
            for f, v in q.items():
                if f.endswith("_ms"):
                    acc.setdefault(f"{q['isa']}/{q['format']}/a{q.get('act_bits')}/T{q['tokens']}/{f}", []).append(v)
    return {k: round(statistics.median(v), 3) for k, v in sorted(acc.items())}


def cpu_ratio_medians(paths: list[str]) -> dict:
    """The same-run ratios on CPU time per call (ms x cpu_util, what the call cost in core time: other
    processes' load on a shared machine stretches wall time, not this), from each run's records,
    median over the runs: each integer format over bf16 and mxfp4 over int8, per ISA, activation
    width and token count (no clamp)."""
    acc: dict = {}
    for p in paths:
        cpu = {key(r): r["ms"] * r["cpu_util"] for r in json.load(open(p))["records"] if r["impl"] == "moesplit"}
        for (isa, fmt, ab, clamp, T), v in cpu.items():
            if clamp or fmt == "bf16":
                continue
            for base_fmt, base_ab, name in (("bf16", None, "cpu_ms_over_bf16_cpu_ms"), ("int8", ab, "cpu_ms_over_int8_cpu_ms")):
                b = cpu.get((isa, base_fmt, base_ab, False, T))
                if b and (base_fmt == "bf16" or fmt == "mxfp4"):
                    acc.setdefault(f"{isa}/{fmt}/a{ab}/T{T}/{name}", []).append(round(v / b, 3))
    return {k: round(statistics.median(v), 3) for k, v in sorted(acc.items())}


def main() -> int:
    """Print the table, write the summary JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--after", nargs="+", required=True)
    ap.add_argument("--before", nargs="*", default=[])
    ap.add_argument("--out")
    a = ap.parse_args()
    after, ceil_a, cpus = medians(a.after)
    before, ceil_b, _ = medians(a.before) if a.before else ({}, {}, [])
    print(f"{'isa':7s}{'fmt':6s}{'act':4s}{'clamp':6s}{'T':>4s} {'before ms':>10s} {'after ms':>10s} {'x':>6s} "
          f"{'GB/s|Gop/s':>11s} {'%read':>6s} {'%peak':>6s} {'%peak/cpu':>9s}")
    table = []
    for k in sorted(after, key=str):
        isa, fmt, ab, clamp, T = k
        r, b = after[k], before.get(k)
        speed = round(b["ms"] / r["ms"], 2) if b else None
        table.append({"isa": isa, "format": fmt, "act_bits": ab, "clamp": clamp, "tokens": T, "after": r,
                      "before": b, "speedup": speed})
        rate = r["gbps"] if T == 1 else r["gflops"]
        print(f"{isa:7s}{fmt:6s}{str(ab or ''):4s}{'yes' if clamp else '':6s}{T:4d} "
              f"{(b['ms'] if b else float('nan')):10.2f} {r['ms']:10.2f} {speed or float('nan'):6.2f} {rate:11.1f} "
              f"{r.get('frac_of_read_bw', 0):6.0%} {r.get('frac_of_compute_peak', 0):6.0%} "
              f"{r.get('frac_of_compute_peak_per_cpu_s', 0):9.0%}")
    ratios = ratio_medians(a.after)
    cpu_ratios = cpu_ratio_medians(a.after)
    for k, v in {**ratios, **cpu_ratios}.items():
        print(f"  {k}: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpus, "after_files": a.after, "before_files": a.before, "ceilings_after": ceil_a,
                       "ceilings_before": ceil_b, "table": table, "same_run_ratios_median": ratios,
                       "same_run_cpu_time_ratios_median": cpu_ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
