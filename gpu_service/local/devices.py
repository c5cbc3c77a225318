"""This box's GPUs for `moesplit doctor`: found without torch (the driver's /proc entries, the PCI
bus in /sys), then, only when there is one, described and timed through torch.cuda (name, memory,
compute capability, host<->device copy bandwidth); and the table of known cards' memory bandwidth
the prediction uses when the card is not measured."""
from __future__ import annotations

import glob
import os
import time

NVIDIA_VENDOR = "0x10de"
# name substring (lower case, most specific first) -> (memory GB as sold, memory bandwidth GB/s, datasheet)
KNOWN_CARDS: tuple[tuple[str, int, float], ...] = (
    ("b200", 192, 8000.0), ("gh200", 96, 4000.0), ("h200", 141, 4800.0), ("h100 nvl", 94, 3900.0),
    ("h100 pcie", 80, 2000.0), ("h100", 80, 3350.0), ("h800", 80, 3350.0), ("a100 80gb pcie", 80, 1935.0),
    ("a100-sxm4-80gb", 80, 2039.0), ("a100", 40, 1555.0), ("l40s", 48, 864.0), ("l40", 48, 864.0),
    ("rtx 6000 ada", 48, 960.0), ("rtx a6000", 48, 768.0), ("rtx 5090", 32, 1792.0), ("rtx 4090", 24, 1008.0),
    ("rtx 3090", 24, 936.0), ("a10", 24, 600.0), ("l4", 24, 300.0), ("v100", 32, 900.0), ("t4", 16, 320.0),
)


def card_bandwidth(name: str) -> tuple[float, str] | None:
    """(GB/s, the table entry) of the first known card whose key the name contains, else None."""
    low = name.lower().replace("-", " ").replace("_", " ")
    for key, _, bw in KNOWN_CARDS:
        if key.replace("-", " ") in low:
            return bw, key
    return None


def card_for_memory(nbytes: int) -> tuple[float, str] | None:
    """(GB/s, key) of the first known card sold with this memory (GB or GiB, within 6%), else None."""
    for key, gb, bw in KNOWN_CARDS:
        if abs(nbytes / 1e9 - gb) / gb < 0.06 or abs(nbytes / 2**30 - gb) / gb < 0.06:
            return bw, key
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pci_gpus(root: str = "/sys/bus/pci/devices") -> list[dict]:
    """NVIDIA display / 3D controllers on the PCI bus with their link (speed, width; current and
    max), from /sys/bus/pci/devices (`root`), no driver or torch needed."""
    out = []
    for d in sorted(glob.glob(os.path.join(root, "*"))):
        if _read(os.path.join(d, "vendor")) != NVIDIA_VENDOR or not (_read(os.path.join(d, "class")) or "").startswith("0x03"):
            continue
        out.append({"pci": os.path.basename(d),
                    **{k: _read(os.path.join(d, k)) for k in ("current_link_speed", "current_link_width",
                                                                "max_link_speed", "max_link_width")}})
    return out


def driver_sees_gpus() -> bool:
    """True when the NVIDIA driver lists a GPU (/proc/driver/nvidia/gpus, /dev/nvidiaN): only then
    is torch imported to ask about it."""
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def copy_gbps(device: int, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Best of `reps` pinned host->device and device->host copies of `nbytes`, GB/s."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    out = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        best = 0.0
        for _ in range(reps):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
        out[name] = round(best, 2)
    del host, dev
    return out


def _pci_address(props) -> str | None:
    """'0000:BB:DD.0' of a torch device's properties, where torch reports the bus."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def gpu_facts(probe: bool = True) -> dict:
    """{"count", "gpus": [...], "pci": [...], "note"}: the GPUs torch.cuda sees (torch imported only
    when the driver lists one, and `probe`); with none, count 0 and the reason, never an error."""
    pci = pci_gpus()
    if not probe:
        return {"count": 0, "gpus": [], "pci": pci, "note": "GPU probe skipped (--no-gpu-probe)"}
    if not driver_sees_gpus():
        return {"count": 0, "gpus": [], "pci": pci, "note": "no NVIDIA GPU: the driver lists none "
                "(/proc/driver/nvidia/gpus, /dev/nvidiaN); the GPU service would run on the CPU"}
    try:
        import torch
    except ImportError as e:
        return {"count": 0, "gpus": [], "pci": pci, "note": f"the driver lists a GPU but torch is not importable: {e}"}
    if not torch.cuda.is_available():
        return {"count": 0, "gpus": [], "pci": pci, "note": f"the driver lists a GPU but torch {torch.__version__} "
                "cannot use it (a CPU-only build, or a driver older than its CUDA): install a CUDA build of torch"}
    gpus = []
    by_pci = {p["pci"]: p for p in pci}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        addr = _pci_address(p)
        g = {"index": i, "name": p.name, "memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}",
             "pci": addr, "link": by_pci.get(addr)}
        known = card_bandwidth(p.name)
        g["table_bandwidth_gbps"] = known[0] if known else None
        g.update(copy_gbps(i))
        gpus.append(g)
    return {"count": len(gpus), "gpus": gpus, "pci": pci, "note": f"torch {torch.__version__}, CUDA {torch.version.cuda}"}


def gpu_findings(facts: dict) -> list[dict]:
    """GPU settings that will cost speed, with their fixes: a link below its maximum, slow copies."""
    out = []
    for g in facts.get("gpus", []):
        link = g.get("link") or {}
        if link.get("current_link_width") and link.get("max_link_width") and link["current_link_width"] != link["max_link_width"]:
            out.append({"what": f"GPU {g['index']} PCIe link x{link['current_link_width']} of x{link['max_link_width']}",
                        "fix": "reseat the card in a full-width slot / check the BIOS lane split"})
        if g.get("h2d_gbps") is not None and g["h2d_gbps"] < 10:
            out.append({"what": f"GPU {g['index']} host->device copies at {g['h2d_gbps']} GB/s (PCIe 4 x16 gives ~25)",
                        "fix": "check the link (nvidia-smi -q | grep -A3 'Link'), IOMMU settings and NUMA locality"})
    return out
