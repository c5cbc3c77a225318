"""The expert hand-off alone: one MoE layer's call round trip over shared memory, in µs.

One shard process (gpu_service.local.stack.start_shards, kernels backend: the shard's C doorbell
loop, cpu_expert_service/kernels/moe_shm.c) holds every expert of a tiny bf16 checkpoint
(gpu_service.local.tiny.make_tiny); the bench process is the GPU side, on CPU. Per batch (1 and 8
rows, top-k of the checkpoint) it times, interleaved in rounds:

  remote    RemoteExperts(client)(layer, h, ids, w).wait(): what the model calls (bf16 hidden on
            the CPU, the client's routing, futures and summing, the C send / wait of FastPath);
  c_raw     the C client alone (FastPath.c.send / wait / read on one slot): the protocol's floor
            from this side, with the shard's own time per call (server_us) beside it;
  remote_py the same RemoteExperts over the experts client this tree had before the C client
            (gpu_service/experts/ of commit PY_CLIENT_COMMIT, read from git history: its futures and
            its Python FastPath; skipped with the reason when git or that commit is not there).
            Nothing outside this bench uses it.

Both sides poll their doorbells for MOESPLIT_SHM_SPIN_US (default here 200 µs, as the Helm chart
sets for dedicated cores; --spin-us 0: block at once). Prints JSON (median and p90 per variant
and batch, the CPU's name); --out FILE writes it too.

    python bench/bench_handoff.py [--calls 2000] [--rounds 5] [--spin-us 200]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpu_expert_service.probes import cpu_description  # noqa: E402

CACHE = os.environ.get("MOESPLIT_BENCH_CACHE", os.path.join(tempfile.gettempdir(), "moesplit-bench-cache"))
PY_CLIENT_COMMIT = "e4c116b"  # the last tree whose FastPath sent and received in Python
BATCHES = (1, 8)


def tiny() -> str:
    from gpu_service.local.tiny import make_tiny

    d = os.path.join(CACHE, "tiny-bf16-handoff")
    if not os.path.exists(os.path.join(d, "generation_config.json")):
        make_tiny(d, "bf16", seed=0)
    return d


OLD_PKG = "bench_handoff_py_client"


class _GitTree(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports OLD_PKG.<name> from gpu_service/experts/<name>.py at PY_CLIENT_COMMIT (its own
    `gpu_service.experts.` imports renamed to OLD_PKG), so that client runs beside today's."""

    def find_spec(self, name, path=None, target=None):
        if name == OLD_PKG or name.startswith(OLD_PKG + "."):
            return importlib.util.spec_from_loader(name, self, is_package=name == OLD_PKG)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == OLD_PKG:
            module.__path__ = []
            return
        rel = module.__name__.split(".", 1)[1]
        src = subprocess.run(["git", "-C", ROOT, "show", f"{PY_CLIENT_COMMIT}:gpu_service/experts/{rel}.py"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        src = src.replace("gpu_service.experts.", OLD_PKG + ".")
        exec(compile(src, f"git:{PY_CLIENT_COMMIT}:gpu_service/experts/{rel}.py", "exec"), module.__dict__)  # noqa: S102


def python_client_class():
    """The ExpertsClient of PY_CLIENT_COMMIT (its futures, its Python FastPath), or (None, why not)."""
    sys.meta_path.insert(0, _GitTree())
    try:
        return importlib.import_module(OLD_PKG + ".client").ExpertsClient, ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot read gpu_service/experts at {PY_CLIENT_COMMIT} from git: {e}"
    except Exception as e:  # noqa: BLE001 - the tree moved on: say so
        return None, f"the experts client of {PY_CLIENT_COMMIT} no longer loads here: {e!r}"


def connect(addresses, cfg, client_class=None):
    """A shm client (bf16 wire): today's, or client_class (the older one)."""
    if client_class is None:
        from gpu_service.experts.client import ExpertsClient as client_class
    return client_class(addresses, cfg, transport="shm", wire_dtype="bfloat16", timeout_s=30).connect()


def inputs(cfg, B: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, cfg.hidden_size, generator=g).to(torch.bfloat16)  # [B, H]
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                       for _ in range(B)])  # [B, k]
    w = torch.rand(B, cfg.num_experts_per_tok, generator=g)  # [B, k]
    return h, ids, w


def time_remote(experts, layer, h, ids, w, n: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        experts(layer, h, ids, w).wait()
        out.append((clock() - t0) / 1e3)
    return out


def time_c_raw(fp, layer, h, ids, w, n: int, seq0: int) -> tuple[list[float], list[float]]:
    """Round trips through fp's C client on slot 0 (fp idle: its own pending calls are none)."""
    from wire import shm as P
    from gpu_service.experts.handoff import _numpy

    x, i, ww = _numpy(h.contiguous()), ids.numpy().astype(np.int64), w.numpy().astype(np.float32)
    assert not fp.pending, "the fast path has calls in flight"
    out, server = [], []
    clock = time.perf_counter_ns
    base = fp.bases[0]
    for s in range(n):
        t0 = clock()
        fp.c.send(0, seq0 + s, layer, x, i, ww, 10_000)
        msg = fp.c.wait(fp.spin_ns, time.monotonic_ns() + 10_000_000_000)
        y = fp.c.read(0, x.shape[0])
        out.append((clock() - t0) / 1e3)
        assert msg is not None and msg[0] == P.OK and msg[2] == seq0 + s and y.shape == x.shape, msg
        server.append(P.RESULT.unpack_from(fp.mm, base + P.RESULT_OFFSET)[1])
    return out, server


def stats(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {"median_us": round(float(np.median(a)), 1), "p90_us": round(float(np.percentile(a, 90)), 1),
            "calls": int(a.size)}


def run(calls: int, rounds: int, spin_us: float) -> dict:
    os.environ["MOESPLIT_SHM_SPIN_US"] = f"{spin_us:g}"  # the shard reads it at start, the client per path
    from checkpoint.config import load_config
    from gpu_service.experts.handoff import RemoteExperts
    from gpu_service.local.stack import start_shards

    d = tiny()
    cfg = load_config(d)
    layer = cfg.moe_layers[0]
    py_client, py_why = python_client_class()
    rec: dict = {"variants": {}}
    with start_shards(d, 1, backend="auto", timeout_s=300) as sh:
        clients = {"remote": connect(sh.addresses, cfg)}
        if py_client is not None:
            clients["remote_py"] = connect(sh.addresses, cfg, py_client)
        try:
            for name, c in clients.items():
                kinds = {fp.kind for fp, _ in c.fast.paths.values() if fp is not None}
                assert kinds == {"shm"}, f"{name}: not on shared memory ({c.fast.reasons})"
            fp = next(iter(clients["remote"].fast.paths.values()))[0]
            experts = {n: RemoteExperts(c) for n, c in clients.items()}
            times: dict = {(v, B): [] for v in (*clients, "c_raw") for B in BATCHES}
            server: dict = {B: [] for B in BATCHES}
            seq = 1 << 40  # apart from the fast path's own sequence numbers
            for B in BATCHES:  # warm-up (the shard's loop, the allocator, the branch predictors)
                h, ids, w = inputs(cfg, B, B)
                for e in experts.values():
                    time_remote(e, layer, h, ids, w, 200)
                time_c_raw(fp, layer, h, ids, w, 200, seq)
                seq += 200
            per = max(1, calls // rounds)
            for r in range(rounds):
                for B in BATCHES:
                    h, ids, w = inputs(cfg, B, 100 * r + B)
                    order = list(experts) if r % 2 == 0 else list(experts)[::-1]
                    for n in order:
                        times[(n, B)] += time_remote(experts[n], layer, h, ids, w, per)
                    t, s = time_c_raw(fp, layer, h, ids, w, per, seq)
                    seq += per
                    times[("c_raw", B)] += t
                    server[B] += s
            c_counts = (fp.c.sent, fp.c.answered)
        finally:
            for c in clients.values():
                c.close()
    for (v, B), xs in times.items():
        rec["variants"].setdefault(v, {})[f"b{B}"] = stats(xs)
    for B in BATCHES:
        rec["variants"]["c_raw"][f"b{B}"]["shard_server_median_us"] = float(np.median(server[B]))
    if py_client is None:
        rec["variants"]["remote_py"] = {"skipped": py_why}
    rec.update({
        "cpu": cpu_description(), "cpus": os.cpu_count(), "spin_us": spin_us, "layer": layer,
        "hidden_size": cfg.hidden_size, "top_k": cfg.num_experts_per_tok, "wire_dtype": "bfloat16",
        "shard": "1 process, kernels backend, C doorbell loop", "c_client_sent_answered": list(c_counts),
        "target_b1_us": 40, "py_client_commit": PY_CLIENT_COMMIT,
    })
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls per variant and batch (default 2000)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds the calls are split into")
    p.add_argument("--spin-us", type=float, default=200.0, help="MOESPLIT_SHM_SPIN_US for both sides")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    rec = run(a.calls, a.rounds, a.spin_us)
    text = json.dumps(rec, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
