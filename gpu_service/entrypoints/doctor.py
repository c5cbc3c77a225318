"""`moesplit doctor`: measure this box (CPU, kernel ISA, NUMA, read bandwidth, dot-product peaks,
hugepages, memlock, /dev/shm, GPUs and their links), name each finding that will cost speed with
its fix, and with `--model` predict decode tokens/s from the memory plan and those ceilings,
printing the formula and its terms (gpu_service.plan.predict).

The CPU half is measured by `python -m cpu_expert_service.probes` in its own process (the probes
bench/bench_kernels.py records; the GPU side imports nothing of the expert side). torch is
imported only when the NVIDIA driver lists a GPU."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from gpu_service.local.devices import card_for_memory, gpu_facts, gpu_findings
from gpu_service.local.stack import ROOT

DEFAULT_HANDOFF_US = 50.0  # one MoE layer's GPU -> shards -> GPU round trip, fixed part (assumed)
DEFAULT_LINK_GBPS = 25.0  # PCIe 4.0 x16, effective (assumed when no GPU is measured)
DEFAULT_CONTEXT = 1024


def _size(s: str) -> int:
    from gpu_service.plan.bytes import parse_size

    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_streams(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--streams {s!r}: expected positive integers, e.g. 1,32")
    return out


def add_prediction_arguments(p: argparse.ArgumentParser) -> None:
    """The prediction's stated inputs (`moesplit doctor` and `moesplit bench`)."""
    p.add_argument("--gpu-bandwidth", type=float, default=None, metavar="GB/s",
                   help="GPU memory bandwidth for the prediction (default: the detected card's, else the table's "
                        "card of --gpu's size)")
    p.add_argument("--handoff-us", type=float, default=None,
                   help=f"fixed hand-off latency per MoE layer, GPU -> shards -> GPU (default {DEFAULT_HANDOFF_US:g}, assumed)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help=f"host<->GPU copy bandwidth (default: measured, else {DEFAULT_LINK_GBPS} assumed)")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens of context per stream, for the KV read (default: doctor {DEFAULT_CONTEXT}, bench: "
                        "its prompts' + half its --max-tokens)")
    p.add_argument("--threads", type=int, default=None, help="probe threads (default: one per allowed CPU, as a shard)")
    p.add_argument("--quick", action="store_true", help="smaller probes (a smoke run, not figures to quote)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None, metavar="PRESET|DIR",
                   help="add a decode prediction for this model (checkpoint dir, config.json or preset)")
    p.add_argument("--gpu", action="append", type=_size, default=None, metavar="SIZE",
                   help="memory of one GPU for the plan, e.g. 24GiB; repeat per GPU (default: the GPUs found)")
    p.add_argument("--streams", type=parse_streams, default=(1, 32), help="concurrent streams to predict (default 1,32)")
    p.add_argument("--no-gpu-probe", action="store_true", help="do not look for GPUs (never imports torch)")
    add_prediction_arguments(p)


def cpu_report(threads: int | None = None, quick: bool = False) -> dict:
    """The expert side's probes (cpu_expert_service.probes.measure) as JSON, from their own process."""
    cmd = [sys.executable, "-m", "cpu_expert_service.probes", "--json"]
    cmd += (["--threads", str(threads)] if threads else []) + (["--quick"] if quick else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"the CPU probes failed (rc {r.returncode}; build the kernels: `make build`): "
                           f"{r.stderr.strip()[-1500:]}")
    return json.loads(r.stdout)


def dot_peak(cpu: dict, fmt: str) -> tuple[float | None, str | None]:
    """(G ops/s, key) of the instruction the shards' GEMM on `fmt` weights runs on, as the probes
    name it (cpu_expert_service.probes.compute_ceiling_key); (None, None) without a probe."""
    key = cpu["ceilings"].get("gemm_peak_key", {}).get(fmt)
    return (cpu["ceilings"].get(key), key) if key else (None, None)


def make_side(cpu: dict, gpus: dict, fmt: str, args: argparse.Namespace, gpu_sizes: list[int] | None,
              gpu_on_cpu: bool = False):
    """The prediction's ceilings: the CPU's measured, the GPU's stated, detected or from the table;
    `gpu_on_cpu`: the GPU side itself runs on this CPU (no CUDA), so it reads at the CPU's bandwidth."""
    from gpu_service.plan.predict import Side

    ceil = cpu["ceilings"]
    peak, key = dot_peak(cpu, fmt)
    src = {"cpu_read_gbps": f"measured: {ceil['read_gbps_method']}",
           "cpu_dot_peak_gops": f"measured: {key}" if peak else "no probe for this ISA"}
    found = gpus.get("gpus") or []
    if args.gpu_bandwidth is not None:
        gbw, src["gpu_gbps"] = args.gpu_bandwidth, "--gpu-bandwidth"
    elif gpu_on_cpu:
        gbw, src["gpu_gbps"] = ceil["read_gbps"], "the GPU side runs on this CPU: its measured read bandwidth"
    elif found and found[0].get("table_bandwidth_gbps"):
        gbw, src["gpu_gbps"] = found[0]["table_bandwidth_gbps"], f"table: detected {found[0]['name']}"
    else:
        hit = card_for_memory(gpu_sizes[0]) if gpu_sizes else None
        if hit is None:
            raise ValueError("no GPU bandwidth: the GPU is neither detected nor a known card of --gpu's size; "
                             "pass --gpu-bandwidth GB/s")
        gbw, src["gpu_gbps"] = hit[0], f"assumed: table card '{hit[1]}' of --gpu's size (pass --gpu-bandwidth)"
    if args.link_gbps is not None:
        link, src["link_gbps"] = args.link_gbps, "--link-gbps"
    elif found:
        link, src["link_gbps"] = found[0]["h2d_gbps"], "measured: pinned host->device copy"
    elif gpu_on_cpu:
        link, src["link_gbps"] = ceil["read_gbps"], "shared memory on this CPU: its read bandwidth"
    else:
        link, src["link_gbps"] = DEFAULT_LINK_GBPS, "assumed: PCIe 4.0 x16"
    handoff = DEFAULT_HANDOFF_US if args.handoff_us is None else args.handoff_us
    src["handoff_us"] = "assumed (--handoff-us)" if args.handoff_us is None else "--handoff-us"
    return Side(ceil["read_gbps"], peak, gbw, handoff, link, src)


def model_prediction(args: argparse.Namespace, cpu: dict, gpus: dict) -> dict:
    """Plan `--model` on `--gpu` (or the GPUs found) and predict decode tokens/s for `--streams`."""
    from gpu_service import plan as P
    from gpu_service.plan.predict import model_bytes_from_plan, predict

    sizes = args.gpu or [g["memory_bytes"] for g in gpus.get("gpus", [])]
    if not sizes:
        raise ValueError("--model needs --gpu SIZE (no GPU found here to plan on), e.g. --gpu 24GiB")
    cfg, name = P.load_model_config(args.model)
    plan = P.make_plan(cfg, sizes, numa_nodes=max(1, len(cpu.get("numa") or [])), model=name,
                       max_batch=max(max(args.streams), P.DEFAULT_MAX_BATCH)).to_json()
    side = make_side(cpu, gpus, plan["options"]["expert_format"], args, sizes)
    out = predict(model_bytes_from_plan(cfg, plan), side, args.streams, args.context or DEFAULT_CONTEXT)
    out.update(model=name, plan_fits=plan["fits"], plan_options=plan["options"])
    return out


def text_lines(rep: dict) -> list[str]:
    """The report as text, in the order a person reads it."""
    from gpu_service.plan.predict import formula_lines

    c, ce, g = rep["cpu"], rep["cpu"]["ceilings"], rep["gpus"]
    nodes = c.get("numa") or []
    gib = lambda n: "?" if n is None else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n >> 20} MiB"  # noqa: E731
    lines = [f"CPU       {c['cpu_model']} ({c['cpus_allowed']} of {c['cpus_online']} CPUs usable)",
             f"kernels   ISA {c['kernel_isa'] or 'none: ' + str(c['kernel_isa_error'])} (available: "
             f"{', '.join(c['kernel_isas_available'])}; MOESPLIT_KERNEL_ISA {c['kernel_isa_env'] or 'unset'}), "
             f"bf16 dot form {c['bf16_dot_form']}",
             f"NUMA      {len(nodes)} node(s): " + "; ".join(f"node {n['node']}: {len(n['cpus'])} CPUs, "
                                                          f"{gib(n['mem_total_bytes'])}" for n in nodes),
             f"memory    {gib(c['mem_total_bytes'])} total, {gib(c['mem_available_bytes'])} available; hugepages "
             f"{c['hugepages_total']} x {gib(c['hugepage_size_bytes'])}; THP {c['thp_enabled']} (defrag "
             f"{c['thp_defrag']}); memlock {'unlimited' if c['memlock_bytes'] is None else gib(c['memlock_bytes'])}; "
             f"/dev/shm {gib(c['dev_shm_bytes'])}",
             f"read bw   {ce['read_gbps']:.2f} GB/s ({ce['read_gbps_method']})"
             + ("; per node (local): " + ", ".join(f"node {k} {v:.2f} GB/s" for k, v in ce["read_gbps_per_node"].items())
                if ce.get("read_gbps_per_node") else "; one NUMA node"),
             "dot peaks " + ", ".join(f"{k[5:]} {v}" for k, v in ce.items() if k.startswith("peak_") and k != "peak_method"
                                      and v is not None) + f" ({ce['threads']} threads)"]
    if g["count"]:
        for d in g["gpus"]:
            link = d.get("link") or {}
            lines.append(f"GPU {d['index']}     {d['name']}, {gib(d['memory_bytes'])}, sm {d['capability']}, PCIe "
                         f"{link.get('current_link_speed', '?')} x{link.get('current_link_width', '?')} (max "
                         f"{link.get('max_link_speed', '?')} x{link.get('max_link_width', '?')}), copies h2d "
                         f"{d['h2d_gbps']} / d2h {d['d2h_gbps']} GB/s")
    else:
        lines.append(f"GPU       none: {g['note']}")
    lines.append("findings" if rep["findings"] else "findings  none")
    lines += [f"  - {f['what']}\n    fix: {f['fix']}" for f in rep["findings"]]
    if rep.get("prediction"):
        p = rep["prediction"]
        lines += [f"model     {p['model']} (plan {'fits' if p['plan_fits'] else 'DOES NOT FIT'}; options "
                  + ", ".join(f"{k} {v}" for k, v in p["plan_options"].items()) + ")", *formula_lines(p)]
    return lines


def prediction_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with add_prediction_arguments' values; None when nothing."""
    for name in ("threads", "context"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    for name in ("gpu_bandwidth", "link_gbps", "handoff_us"):
        v = getattr(args, name)
        if v is not None and (v < 0 or (v == 0 and name != "handoff_us")):
            return f"--{name.replace('_', '-')} must be {'>= 0' if name == 'handoff_us' else '> 0'}, got {v}"
    return None


def _input_error(args: argparse.Namespace, gpus: dict) -> str | None:
    """What is wrong with the arguments, found before anything is measured; None when nothing."""
    err = prediction_args_error(args)
    if err:
        return err
    if args.model:
        from checkpoint.config import ConfigError
        from gpu_service.plan.report import load_model_config

        try:
            load_model_config(args.model)
        except ConfigError as e:
            return str(e)
        if not args.gpu and not gpus.get("count"):
            return "--model needs --gpu SIZE (no GPU found here to plan on), e.g. --gpu 24GiB"
    return None


def run(args: argparse.Namespace) -> int:
    gpus = gpu_facts(probe=not args.no_gpu_probe)
    err = _input_error(args, gpus)
    if err:
        print(f"moesplit doctor: {err}", file=sys.stderr)
        return 2
    try:
        cpu = cpu_report(args.threads, args.quick)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"moesplit doctor: {e}", file=sys.stderr)
        return 1
    rep = {"cpu": cpu, "gpus": gpus, "findings": cpu.pop("findings") + gpu_findings(gpus)}
    if args.model:
        from checkpoint.config import ConfigError

        try:
            rep["prediction"] = model_prediction(args, cpu, gpus)
        except (ConfigError, ValueError) as e:
            print(f"moesplit doctor: {e}", file=sys.stderr)
            return 2
    print(json.dumps(rep) if args.json else "\n".join(text_lines(rep)))
    return 0
