"""The shard's shared-memory loop (cpu_expert_service/kernels/moe_shm.c) per one-token call.

One shard process (gpu_service.local.stack.start_shards) holds every expert of the tiny bf16 model
(gpu_service.local.tiny.make_tiny, hidden 96, top-k of its config); a raw client plays the GPU side
as tests/test_shm_shard_loop.py's _raw / _ring do: write one call (T = 1) into a slot, ring the
doorbell, block in recv() for the answer, read the output. Per backend (kernels: the compute in C;
numpy: its forward called back with the GIL) and wire dtype, after a warm-up:

  server_us   the shard's service time, written by the shard into the slot: doorbell received ->
              answer sent (validation, conversions, compute, write-back), whole µs
  compute_us  the compute alone (moe_forward, or the callback), whole µs
  rtt_us      the client's round trip: slot written -> doorbell -> answer received -> output read

Calls follow each other at once; the doorbell spin is off (MOESPLIT_SHM_SPIN_US unset = 0), so each
end is woken by the kernel. Prints JSON (median, p10, p90 of each) and writes it to
bench/results/shm_loop.json.

    python bench/bench_shm_loop.py [--calls N] [--backends kernels,numpy] [--wires float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wire import shm as P  # noqa: E402
from cpu_expert_service.probes import cpu_description  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _stats(a) -> dict:
    a = np.asarray(a, dtype=np.float64)
    return {"median": round(float(np.median(a)), 1), "p10": round(float(np.percentile(a, 10)), 1),
            "p90": round(float(np.percentile(a, 90)), 1)}


def time_calls(address: str, cfg, wire: str, calls: int, warmup: int) -> dict:
    """One raw client's one-token calls to `address`, alternating two slots."""
    import grpc

    from gpu_service.experts.shm import negotiate

    ch = grpc.insecure_channel(address)
    fp, why = negotiate(ch, address, cfg.hidden_size, cfg.num_experts_per_tok, "/dev/shm", wire, 8, 2)
    if fp is None:
        raise SystemExit(f"the shard refused the shared-memory fast path: {why}")
    fp.sock.setblocking(True)
    lay, code, dt = fp.lay, P.code_of(wire), P.DTYPES[P.code_of(wire)]
    H, K = cfg.hidden_size, cfg.num_experts_per_tok
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H)).astype(dt)  # [1, H]
    ids = rng.choice(cfg.n_routed_experts, K, replace=False).reshape(1, K).astype(np.int64)  # [1, K]
    w = rng.random((1, K)).astype(np.float32)  # [1, K]
    views = []
    for slot in (0, 1):
        base = lay.slot_base(slot)
        views.append((base, P.view(fp.mm, base + lay.hidden_off, (1, H), dt), P.view(fp.mm, base + lay.ids_off, (1, K),
                      np.dtype(np.int64)), P.view(fp.mm, base + lay.w_off, (1, K), np.dtype(np.float32)),
                      P.view(fp.mm, base + lay.out_off, (1, H), dt)))
    server, compute, rtt = [], [], []
    send, recv, pack, clock = fp.sock.send, fp.sock.recv, P.DOORBELL.pack, time.perf_counter_ns
    try:
        for i in range(warmup + calls):
            slot = i & 1
            base, xv, iv, wv, ov = views[slot]
            t0 = clock()
            xv[...], iv[...], wv[...] = x, ids, w
            P.CALL.pack_into(fp.mm, base, cfg.moe_layers[0], 1, K, code, 4, 0, code, 0, 0, 0)
            send(pack(P.OP_FORWARD, slot, i))
            status, _, _ = P.DOORBELL.unpack(recv(16))
            out = ov.copy()
            t1 = clock()
            if status != P.OK or not np.isfinite(out.astype(np.float32)).all():
                raise SystemExit(f"call {i}: status {status}")
            if i >= warmup:
                c_us, s_us, _ = P.RESULT.unpack_from(fp.mm, base + P.RESULT_OFFSET)
                server.append(s_us), compute.append(c_us), rtt.append((t1 - t0) / 1e3)
    finally:
        fp.close()
        ch.close()
    return {"server_us": _stats(server), "compute_us": _stats(compute), "rtt_us": _stats(rtt), "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--backends", default="kernels,numpy")
    ap.add_argument("--wires", default="float32,bfloat16")
    args = ap.parse_args()
    from checkpoint.config import load_config
    from gpu_service.local.stack import start_shards
    from gpu_service.local.tiny import make_tiny

    model = make_tiny(os.path.join(tempfile.mkdtemp(prefix="bench-shm-loop-"), "tiny"), "bf16", seed=5)
    cfg = load_config(model)
    from cpu_expert_service.kernel_backend import AVAILABLE_ISAS

    res = {"machine": {"cpu": cpu_description(), "kernel_isas": list(AVAILABLE_ISAS), "cpus": os.cpu_count(),
                       "loadavg_at_start": os.getloadavg(),
                       "python": platform.python_version(), "spin_us": os.environ.get(P.SPIN_ENV, "0")},
           "model": {"hidden_size": cfg.hidden_size, "top_k": cfg.num_experts_per_tok,
                     "n_routed_experts": cfg.n_routed_experts, "moe_intermediate_size": cfg.moe_intermediate_size},
           "definition": __doc__, "results": {}}
    for backend in args.backends.split(","):
        with start_shards(model, 1, backend=backend, timeout_s=300) as sh:
            for wire in args.wires.split(","):
                r = time_calls(sh.addresses[0], cfg, wire, args.calls, args.warmup)
                res["results"][f"{backend}/{wire}/T1"] = r
                print(f"[{backend} {wire}] server {r['server_us']['median']} µs, compute {r['compute_us']['median']} "
                      f"µs, round trip {r['rtt_us']['median']} µs", file=sys.stderr, flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "shm_loop.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
