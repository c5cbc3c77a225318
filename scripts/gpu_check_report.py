"""`make gpu-check`'s Python side: the import preflight, the wheels to install, and the one JSON report.

    gpu_check_report.py preflight [OUT]    import every module the gpu checks load, with the packages
                                           a lent GPU machine lacks (fastapi, uvicorn, pydantic,
                                           openai, grpc_health) refused; exit 1 naming what failed
                                           (also written to OUT/preflight.txt for the report)
    gpu_check_report.py wheels DIR         the wheels in DIR whose distribution is not installed or
                                           older (one path a line: what `pip install --target` adds)
    gpu_check_report.py unpack TARGET WHEEL...
                                           unzip wheels into TARGET (where pip is missing)
    gpu_check_report.py report OUT [--dry-run]
                                           read OUT's machine.txt, torch.txt, junit.xml, records.jsonl
                                           and bench_gpu.json; print one JSON (and write OUT/report.json);
                                           exit 1 on a failed / skipped test or a mismatch. --dry-run
                                           checks the report's shape from empty inputs (CPU, `make test`)

docs/gpu-first-run.md explains every field.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.metadata
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absent on the lent machine (its interpreter has torch and little else): the gpu checks must not need them
ABSENT = ("fastapi", "uvicorn", "pydantic", "openai", "starlette", "grpc_health")
# what the gpu checks import: the gpu-marked test files and the benchmark
CHECK_MODULES = ("test_gpu", "test_decode", "test_doctor", "test_v4_decode", "bench.bench_gpu")
# the report's keys (the dry run checks them; docs/gpu-first-run.md describes each)
KEYS = ("ok", "problems", "machine", "torch", "build", "tests", "records", "graphs_vs_eager", "real_shapes_layer",
        "linears", "dry_run")


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses the packages in ABSENT, as if they were not installed."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (refused: absent on the lent GPU machine)")
        return None


def preflight(out_dir: str | None = None) -> int:
    """Import each check module with ABSENT refused; print what failed and why (and write it to
    out_dir/preflight.txt, one line each)."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    sys.meta_path.insert(0, _Refuse())
    bad = []
    for mod in CHECK_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
            bad.append(f"{mod}: {type(e).__name__}: {e}")
    for b in bad:
        print(f"gpu-check preflight: cannot import {b}; carry a wheel of the missing package in "
              "$GPU_CHECK_WHEELS (pip download --python-version 3.12 --only-binary=:all:)", file=sys.stderr)
    print(f"gpu-check preflight: {len(CHECK_MODULES) - len(bad)}/{len(CHECK_MODULES)} modules import")
    if out_dir is not None:
        with open(os.path.join(out_dir, "preflight.txt"), "w") as f:
            f.write("".join(b + "\n" for b in bad))
    return 1 if bad else 0


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:4])


def missing_wheels(folder: str) -> list[str]:
    """The wheels in `folder` whose distribution is not installed for this interpreter, or is
    installed at an older version (the generated protos need protobuf >= 7.35.1, grpcio >= 1.85.1):
    they go first on PYTHONPATH; what is installed at that version or newer is left alone."""
    out = []
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".whl"):
            continue
        dist, version = f.split("-")[:2]
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or _numbers(have) < _numbers(version):
            out.append(os.path.join(folder, f))
    return out


def unpack(target: str, wheels: list[str]) -> int:
    """Unzip each wheel into `target` (a wheel holds its site-packages tree as it is installed)."""
    import zipfile

    os.makedirs(target, exist_ok=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(target)
        print(f"gpu-check: unpacked {os.path.basename(w)} into {target}")
    return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine(text: str) -> dict:
    """GPU name / driver (nvidia-smi --query-gpu csv lines), CPU model (lscpu) and AMX flags."""
    gpus = [dict(zip(("name", "driver", "memory"), (p.strip() for p in line.split(","))))
            for line in re.findall(r"^GPU: (.*)$", text, re.M)]
    cpu = re.search(r"^Model name:\s*(.+)$", text, re.M)
    return {"gpus": gpus, "cpu": cpu.group(1).strip() if cpu else None,
            "amx": sorted(set(re.findall(r"\bamx_[a-z0-9_]+", text)))}


def junit(path: str) -> dict:
    """passed / failed / skipped counts and the failed and skipped test ids."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {"ran": False, "passed": 0, "failed": [], "skipped": []}
    failed, skipped, passed = [], [], 0
    for c in root.iter("testcase"):
        tid = f"{c.get('classname')}::{c.get('name')}"
        if c.find("failure") is not None or c.find("error") is not None:
            failed.append(tid)
        elif c.find("skipped") is not None:
            skipped.append(tid)
        else:
            passed += 1
    return {"ran": True, "passed": passed, "failed": failed, "skipped": skipped}


def records(path: str) -> dict:
    """The gpu tests' measurements (tests/test_gpu.py `record`), by name: a list per name."""
    out: dict[str, list] = {}
    for line in _read(path).splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r.pop("name"), []).append(r)
    return out


def report(out_dir: str, dry_run: bool) -> tuple[dict, list[str]]:
    """The one JSON of a gpu-check run, and the problems that make it fail."""
    torch_line = _read(os.path.join(out_dir, "torch.txt")).strip().splitlines()
    bench = json.loads(_read(os.path.join(out_dir, "bench_gpu.json")) or "{}")
    rep = {"machine": machine(_read(os.path.join(out_dir, "machine.txt"))),
           "torch": torch_line[-1] if torch_line else None,
           "build": _read(os.path.join(out_dir, "build_status")).strip() or None,
           "tests": junit(os.path.join(out_dir, "junit.xml")),
           "records": records(os.path.join(out_dir, "records.jsonl")),
           "graphs_vs_eager": bench.get("cuda_graphs_vs_eager", []),
           "real_shapes_layer": bench.get("real_shapes_layer", []),
           "linears": bench.get("linears", []),
           "dry_run": dry_run}
    problems = [f"cannot import {line}" for line in _read(os.path.join(out_dir, "preflight.txt")).splitlines()
                if line.strip()]
    if not dry_run:
        t = rep["tests"]
        if rep["build"] != "ok":
            tail = " | ".join(_read(os.path.join(out_dir, "build.txt")).strip().splitlines()[-3:])
            problems.append(f"building the C extensions: {rep['build'] or 'not run'} ({tail})")
        if not t["ran"]:
            problems.append("no junit report: pytest did not run")
        problems += [f"failed: {x}" for x in t["failed"]] + [f"skipped: {x}" for x in t["skipped"]]
        if not rep["graphs_vs_eager"]:
            problems.append("no CUDA-graphs-vs-eager benchmark rows")
        problems += [f"CUDA graphs changed the tokens at batch {r['batch']}" for r in rep["graphs_vs_eager"]
                     if not r.get("tokens_equal")]
        if not rep["real_shapes_layer"]:
            problems.append("no real-shapes layer benchmark rows")
        problems += [f"CUDA graphs changed the tokens of the {r['preset']} layer at batch {r['batch']}"
                     for r in rep["real_shapes_layer"] if not r.get("tokens_equal")]
        problems += [f"{name}: {r}" for name, rs in rep["records"].items() for r in rs if r.get("ok") is False]
    rep["ok"], rep["problems"] = not problems, problems
    return {k: rep[k] for k in KEYS}, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pf = sub.add_parser("preflight")
    pf.add_argument("out", nargs="?")
    w = sub.add_parser("wheels")
    w.add_argument("folder")
    u = sub.add_parser("unpack")
    u.add_argument("target")
    u.add_argument("wheels", nargs="+")
    r = sub.add_parser("report")
    r.add_argument("out")
    r.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "preflight":
        return preflight(args.out)
    if args.cmd == "unpack":
        return unpack(args.target, args.wheels)
    if args.cmd == "wheels":
        print("\n".join(missing_wheels(args.folder)))
        return 0
    rep, problems = report(args.out, args.dry_run)
    text = json.dumps(rep, indent=1)
    print(text)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        f.write(text + "\n")
    for p in problems:
        print(f"gpu-check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
