"""This machine's ceilings for the expert kernels, measured, and the host facts that bound them:
the one implementation `moesplit doctor` and bench/bench_kernels.py both use.

- `read_bandwidth_gbps`: a streaming read by the kernels' own pinned pool (moe_probe_read in C);
- `probe_gops` / `PROBES`: the peak of one dot-product instruction (vfmadd / vdpbf16ps / vpdpbusd,
  AVX2 vfmadd / vpmaddubsw), `COMPUTE_CEILING`: which one a (ISA, format) GEMM runs on;
  `REPRESENTATION_CEILINGS`: the exact minimal loops that bound a representation below that peak;
- `theoretical_peaks`: clock x cores x ops per cycle, beside the probed peaks;
- `host_facts`: CPU model, kernel ISA (as a backend picks it: `kernel_backend.select_isa`), NUMA
  nodes, hugepages / THP, memlock and /dev/shm limits;
- `measure`: all of the above as one dict; `python -m cpu_expert_service.probes --json` prints it
  (how the GPU side's `moesplit doctor` asks, as a process: the services import nothing of each other).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import threading
import time

import numpy as np

READ_BYTES = 2 << 30  # the read probe's buffer: far beyond any last-level cache
READ_PASSES = 5
PEAK_ITERS = 5 * 10**7
PEAK_PASSES = 3

# probe kind -> (ceiling key, ops per cycle per core at 2 vector ports: the nominal rate)
PROBES = {
    "fma_f32": ("peak_fma_f32_gflops", 2 * 32), "dpbf16": ("peak_dpbf16_gflops", 2 * 64),
    "vnni_int8": ("peak_vnni_int8_gops", 2 * 128),
    "fma_f32_avx2": ("peak_fma_f32_avx2_gflops", 2 * 16), "maddubs_int8_avx2": ("peak_maddubs_int8_avx2_gops", 2 * 64),
}
# which ceiling a GEMM of (ISA, format) is held to beyond 1 token: the instruction it runs on
COMPUTE_CEILING = {("avx512", "bf16"): "peak_dpbf16_gflops", ("avx512", "int8"): "peak_vnni_int8_gops",
                   ("avx512", "int4"): "peak_vnni_int8_gops", ("avx2", "bf16"): "peak_fma_f32_avx2_gflops",
                   ("avx2", "int8"): "peak_maddubs_int8_avx2_gops", ("avx2", "int4"): "peak_maddubs_int8_avx2_gops",
                   ("avx512", "mxfp4"): "peak_vnni_int8_gops", ("avx2", "mxfp4"): "peak_maddubs_int8_avx2_gops"}
# a representation's own ceiling below its instruction's peak, per (ISA, format, activation bits): the
# probe kinds of its exact minimal loop (the best of them bounds the kernel). AVX2 int8 weights are signed
# 8-bit, so vpmaddubsw's u8 x s8 pairs would saturate: an exact dot takes vpmaddwd on int16 weights or the
# sign trick, two multiply-port ops per 32 products (moe_probe_avx2 kinds 2, 3).
REPRESENTATION_CEILINGS = {("avx2", "int8", 8): ("int8_exact_wd_avx2", "int8_exact_sign_avx2"),
                           ("avx2", "int8", 16): ("int8_exact_wd_avx2",)}
READ_METHOD = ("C streaming read (moe_probe_read) of {gib} GiB by the kernels' pool, {threads} pinned threads, "
               "256-bit loads, best of {passes}")
PEAK_METHOD = ("{threads} threads x 12 independent vector chains of one instruction (vfmadd ps zmm / vdpbf16ps / "
               "vpdpbusd; AVX2: vfmadd ps ymm / vpmaddubsw), cpu_expert_service.kernels._moe.probe_peak, best of "
               "{passes}; 2 ops per multiply-add")


def compute_ceiling_key(isa: str | None, fmt: str, bf16_form: str | None = None) -> str | None:
    """The peak key a GEMM of `fmt` weights on kernel `isa` is bound by (amx: its AVX-512 form);
    AVX-512 bf16 in the "fma" form (`_moe.bf16_dot_form()`: widened weights x f32 FMA) is bound by
    the f32 FMA peak. None for the generic kernels (no probe)."""
    isa = "avx512" if isa == "amx" else isa
    if isa == "avx512" and fmt == "bf16" and bf16_form == "fma":
        return "peak_fma_f32_gflops"
    return COMPUTE_CEILING.get((isa, fmt))


def default_threads() -> int:
    """Threads a shard's kernels use by default: one per CPU this process may run on."""
    from cpu_expert_service.kernel_backend import allowed_cpus

    return len(allowed_cpus())


def read_bandwidth_gbps(threads: int | None = None, passes: int = READ_PASSES, nbytes: int = READ_BYTES) -> float:
    """Best of `passes` streaming reads of an `nbytes` buffer by the kernels' own pool (`threads`
    pinned threads, each its contiguous share, 256-bit loads: moe_probe_read in C), so the
    ceiling is what a weight stream of these threads can get."""
    from cpu_expert_service.kernel_backend import KernelExperts

    be = KernelExperts("bf16", num_threads=threads or default_threads())
    raw = np.ones(nbytes + 64, dtype=np.uint8)  # touched
    off = (-raw.ctypes.data) % 64
    buf = raw[off:off + nbytes]
    best = max(buf.nbytes / be.read_seconds(buf) / 1e9 for _ in range(passes))
    del be, raw, buf
    return best


def node_read_gbps(cpus: list[int], passes: int = READ_PASSES, nbytes: int = READ_BYTES) -> float:
    """read_bandwidth_gbps with this process confined to `cpus` (one NUMA node's) while the buffer
    is allocated, touched and read: the kernels' pool on that node reading node-local memory."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return read_bandwidth_gbps(len(cpus), passes, nbytes)
    finally:
        os.sched_setaffinity(0, before)


def probe_gops(kind: str, threads: int | None = None, iters: int = PEAK_ITERS, passes: int = PEAK_PASSES) -> float | None:
    """This machine's peak of one instruction kind (a key of PROBES) in G ops/s, on `threads`
    threads at once, each running 12 independent vector chains (_moe.probe_peak), best of
    `passes`; None when the CPU lacks the instruction."""
    from cpu_expert_service.kernels import _moe

    if not _moe.cpu_has(_moe.PROBES[kind][0]):
        return None
    best = 0.0
    for _ in range(passes):
        done: list[float] = []
        ths = [threading.Thread(target=lambda: done.append(_moe.probe_peak(kind, iters)))
               for _ in range(threads or default_threads())]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        best = max(best, sum(done) / (time.perf_counter() - t) / 1e9)
    return best


def probe_gops_per_cpu_second(kind: str, iters: int = 2 * 10**7, passes: int = 3) -> float | None:
    """One instruction kind's peak on this one thread in G ops per second of the thread's CPU time
    (best of `passes`): what a core does per second it actually runs, so a shared machine's other
    load cancels in a ratio against a record timed the same way; None when the CPU lacks it."""
    from cpu_expert_service.kernels import _moe

    if not _moe.cpu_has(_moe.PROBES[kind][0]):
        return None
    best = 0.0
    for _ in range(passes):
        t = time.thread_time()
        ops = _moe.probe_peak(kind, iters)
        best = max(best, ops / max(time.thread_time() - t, 1e-9) / 1e9)
    return best


def cpu_clock_ghz() -> tuple[float | None, str]:
    """The core clock the nominal peaks use: cpufreq's maximum, else /proc/cpuinfo's MHz."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return int(f.read()) / 1e6, "cpufreq cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return (max(mhz) / 1e3, "/proc/cpuinfo cpu MHz") if mhz else (None, "unknown")
    except OSError:
        return None, "unknown"


def _cpuinfo_field(name: str) -> str:
    """One field of /proc/cpuinfo's first processor ('' when absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(8192)
    except OSError:
        return ""
    line = next((ln for ln in head.splitlines() if ln.split(":")[0].strip() == name), ":")
    return line.split(":", 1)[1].strip()


def cpu_vendor_family_model() -> tuple[str, int, int]:
    """(vendor_id, cpu family, model) from /proc/cpuinfo; ("", 0, 0) where unreadable."""
    try:
        return _cpuinfo_field("vendor_id"), int(_cpuinfo_field("cpu family") or 0), int(_cpuinfo_field("model") or 0)
    except ValueError:
        return _cpuinfo_field("vendor_id"), 0, 0


def cpu_description() -> str:
    """The CPU a figure was measured on, for benchmark records: /proc/cpuinfo's model name, family,
    model and the AVX-512 BF16 / VNNI and AMX flags it has (else the platform's name)."""
    name = _cpuinfo_field("model name")
    if not name:
        import platform

        return platform.processor() or platform.machine() or "unknown"
    flags = set(_cpuinfo_field("flags").split())
    isa = [f for f in ("avx2", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{name} (family {_cpuinfo_field('cpu family')} model {_cpuinfo_field('model')}; {', '.join(isa) or 'no AVX2'})"


def theoretical_peaks(threads: int | None = None) -> dict:
    """Nominal peaks from clock x cores x ops per cycle, beside the probed ones: 2 vector ports per
    core at full width, except where AMD splits a wide op into halves (Zen 4, family 19h: 512-bit
    ops as two 256-bit halves; Zen 1, family 17h models < 30h: 256-bit ops as two 128-bit halves)."""
    threads = threads or default_threads()
    ghz, src = cpu_clock_ghz()
    vendor, family, model = cpu_vendor_family_model()
    amd = vendor == "AuthenticAMD"
    zen1 = amd and family == 0x17 and model < 0x30
    out = {"clock_ghz": round(ghz, 3) if ghz else None,
           "theoretical_method": (f"clock ({src}) x {threads} cores x ops/cycle at 2 full-width vector ports per "
                                  f"core; {vendor or 'unknown vendor'} family {family:#x} model {model:#x}"
                                  + ("; 512-bit ops at half rate" if amd else "")
                                  + ("; 256-bit ops at half rate (Zen 1)" if zen1 else ""))}
    for kind, (key, per_cycle) in PROBES.items():
        if ghz:
            half = (amd and not kind.endswith("avx2")) or (zen1 and kind.endswith("avx2"))
            out[key.replace("peak_", "theoretical_")] = round(ghz * threads * per_cycle / (2 if half else 1), 1)
    return out


def _read(path: str) -> str | None:
    """A small /sys or /proc file's text, stripped; None where unreadable."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_list(s: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in filter(None, s.split(",")):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def numa_nodes() -> list[dict]:
    """[{node, cpus, mem_total_bytes}] from /sys/devices/system/node (one node 0 with every CPU
    where the kernel has no NUMA)."""
    out = []
    for d in sorted(glob.glob("/sys/devices/system/node/node[0-9]*"), key=lambda p: int(p.rsplit("node", 1)[1])):
        cpus = _cpu_list(_read(os.path.join(d, "cpulist")) or "")
        mem = next((int(ln.split()[-2]) * 1024 for ln in (_read(os.path.join(d, "meminfo")) or "").splitlines()
                    if "MemTotal:" in ln), None)
        out.append({"node": int(d.rsplit("node", 1)[1]), "cpus": cpus, "mem_total_bytes": mem})
    return out or [{"node": 0, "cpus": list(range(os.cpu_count() or 1)), "mem_total_bytes": None}]


def _bracketed(s: str | None) -> str | None:
    """The [selected] word of a sysfs choice list ('always [madvise] never' -> 'madvise')."""
    if not s:
        return None
    return next((w[1:-1] for w in s.split() if w.startswith("[")), s)


def memory_facts() -> dict:
    """Hugepages, transparent hugepages, the memlock limit and /dev/shm's size."""
    meminfo = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in (_read("/proc/meminfo") or "").splitlines()
               if ":" in ln}
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    except OSError:
        shm = None

    def kib(key):
        v = meminfo.get(key)
        return int(v.split()[0]) * 1024 if v else None

    return {"mem_total_bytes": kib("MemTotal"), "mem_available_bytes": kib("MemAvailable"),
            "hugepages_total": int(meminfo["HugePages_Total"]) if "HugePages_Total" in meminfo else None,
            "hugepages_free": int(meminfo["HugePages_Free"]) if "HugePages_Free" in meminfo else None,
            "hugepage_size_bytes": kib("Hugepagesize"),
            "thp_enabled": _bracketed(_read("/sys/kernel/mm/transparent_hugepage/enabled")),
            "thp_defrag": _bracketed(_read("/sys/kernel/mm/transparent_hugepage/defrag")),
            "memlock_bytes": None if soft == resource.RLIM_INFINITY else soft,
            "memlock_hard_bytes": None if hard == resource.RLIM_INFINITY else hard,
            "dev_shm_bytes": shm}


def host_facts() -> dict:
    """What this machine is, before anything is timed: CPU, kernel ISA, NUMA layout, memory settings."""
    from cpu_expert_service.kernel_backend import AVAILABLE_ISAS, ISA_ENV, allowed_cpus, select_isa
    from cpu_expert_service.kernels import _moe

    try:
        isa, isa_error = select_isa(), None
    except (ValueError, RuntimeError) as e:  # a bad $MOESPLIT_KERNEL_ISA: what a shard would refuse to start with
        isa, isa_error = None, str(e)
    governor = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    return {"cpu_model": _cpuinfo_field("model name") or "unknown", "cpu_vendor_family_model": list(cpu_vendor_family_model()),
            "cpus_online": os.cpu_count(), "cpus_allowed": len(allowed_cpus()),
            "kernel_isa": isa, "kernel_isa_error": isa_error, "kernel_isa_env": os.environ.get(ISA_ENV),
            "kernel_isas_available": list(AVAILABLE_ISAS), "bf16_dot_form": _moe.bf16_dot_form(),
            "cpufreq_governor": governor, "numa": numa_nodes(), **memory_facts()}


def measure(threads: int | None = None, quick: bool = False) -> dict:
    """host_facts() plus the measured ceilings (as bench/bench_kernels.py records them); `quick`:
    a 512 MiB read buffer, 2 passes, fewer peak iterations (a smoke run, not a figure to quote)."""
    threads = threads or default_threads()
    nbytes, rpasses = (512 << 20, 2) if quick else (READ_BYTES, READ_PASSES)
    iters, ppasses = (PEAK_ITERS // 10, 2) if quick else (PEAK_ITERS, PEAK_PASSES)
    out = host_facts()
    t0 = time.perf_counter()
    ceil = {"threads": threads, "read_gbps": round(read_bandwidth_gbps(threads, rpasses, nbytes), 2),
            "read_gbps_method": READ_METHOD.format(gib=nbytes / 2**30, threads=threads, passes=rpasses)}
    for kind, (key, _) in PROBES.items():
        g = probe_gops(kind, threads, iters, ppasses)
        ceil[key] = round(g, 1) if g else None
    ceil["peak_method"] = PEAK_METHOD.format(threads=threads, passes=ppasses)
    ceil["gemm_peak_key"] = {fmt: compute_ceiling_key(out["kernel_isa"], fmt, out["bf16_dot_form"])
                             for fmt in ("bf16", "int8", "int4")}  # the peak each format's GEMM runs at
    nodes = [n for n in out["numa"] if n["cpus"] and set(n["cpus"]) <= set(os.sched_getaffinity(0))]
    if len(nodes) > 1:  # each node's own: its CPUs reading memory they first touched (node-local)
        ceil["read_gbps_per_node"] = {str(n["node"]): round(node_read_gbps(n["cpus"], rpasses, nbytes), 2) for n in nodes}
        ceil["read_gbps_across_nodes_method"] = ("read_gbps: every allowed CPU reading one buffer first touched by "
                                                 "one thread (one node's memory), as a shard spanning nodes")
    ceil.update({k: v for k, v in theoretical_peaks(threads).items()  # only for instructions this CPU has
                 if not k.startswith("theoretical_") or k == "theoretical_method"
                 or ceil.get(k.replace("theoretical_", "peak_")) is not None})
    ceil["probe_s"] = round(time.perf_counter() - t0, 2)
    out["ceilings"] = ceil
    out["findings"] = findings(out)
    return out


GiB = 1 << 30


def findings(facts: dict) -> list[dict]:
    """Each host setting that will cost speed (or fail a start), with its fix: [{what, fix}]."""
    out = []
    best = (facts.get("kernel_isas_available") or ["generic"])[0]
    if facts.get("kernel_isa_error"):
        out.append({"what": facts["kernel_isa_error"], "fix": "unset MOESPLIT_KERNEL_ISA"})
    elif facts.get("kernel_isa") != best:
        out.append({"what": f"MOESPLIT_KERNEL_ISA={facts.get('kernel_isa_env')} runs the {facts['kernel_isa']} kernels; "
                            f"this CPU runs {best}", "fix": "unset MOESPLIT_KERNEL_ISA"})
    if best in ("avx2", "generic"):
        out.append({"what": f"kernels run {best}: no AVX-512 BF16/VNNI, the dot products run at half rate or less",
                    "fix": "shards on a CPU with AVX-512 BF16 + VNNI (Zen 4+, Sapphire Rapids+) decode faster"})
    nodes = facts.get("numa") or []
    if len(nodes) > 1:
        out.append({"what": f"{len(nodes)} NUMA nodes: one shard across nodes reads half its weights over the "
                            "inter-socket link", "fix": f"one shard per node: `moesplit plan --numa-nodes {len(nodes)}` "
                            "and `numactl --cpunodebind=N --membind=N moesplit expert-server ...`"})
    if facts.get("cpus_allowed") and facts.get("cpus_online") and facts["cpus_allowed"] < facts["cpus_online"]:
        out.append({"what": f"this process may use {facts['cpus_allowed']} of {facts['cpus_online']} CPUs "
                            "(affinity / cgroup): the kernels' pool gets that many threads",
                    "fix": "give the shard the CPUs of its NUMA node (taskset / the pod's CPU request)"})
    if facts.get("cpufreq_governor") not in (None, "performance"):
        out.append({"what": f"cpufreq governor {facts['cpufreq_governor']}: cores clock down between steps",
                    "fix": "`cpupower frequency-set -g performance`"})
    if facts.get("thp_enabled") != "always" and not facts.get("hugepages_total"):
        out.append({"what": f"transparent hugepages '{facts.get('thp_enabled')}' and no reserved hugepages: the "
                            "experts' weights sit on 4 KiB pages (TLB misses on every weight stream)",
                    "fix": "`echo always > /sys/kernel/mm/transparent_hugepage/enabled`, or reserve hugepages "
                           "(the Helm chart: experts.hugepagesSize)"})
    ml = facts.get("memlock_bytes")
    if ml is not None and ml < GiB:
        out.append({"what": f"memlock {ml // 1024} KiB: pinned staging buffers and the host KV tier cannot be "
                            "locked", "fix": "raise `ulimit -l` (unlimited; docker --ulimit memlock=-1)"})
    shm = facts.get("dev_shm_bytes")
    if shm is not None and shm < 256 << 20:
        out.append({"what": f"/dev/shm is {shm >> 20} MiB: the shared-memory hand-off may not fit its slots and "
                            "falls back to TCP / gRPC", "fix": "a larger /dev/shm (docker --shm-size=1g) or "
                                                               "MOESPLIT_SHM_DIR on a larger tmpfs"})
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m cpu_expert_service.probes [--json] [--threads N] [--quick]`."""
    ap = argparse.ArgumentParser(prog="python -m cpu_expert_service.probes", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--threads", type=int, default=None, help="probe threads (default: one per allowed CPU)")
    ap.add_argument("--quick", action="store_true", help="smaller read buffer and fewer iterations (smoke runs)")
    ap.add_argument("--facts-only", action="store_true", help="the host facts, nothing timed")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    res = host_facts() if args.facts_only else measure(args.threads, args.quick)
    if args.facts_only:
        res["findings"] = findings(res)
    print(json.dumps(res, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
