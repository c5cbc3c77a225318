"""The expert hand-off across hosts: one MoE layer's call round trip over the TCP data path between two
network namespaces (tests/nethosts.py: own addresses, a veth pair each to a bridge), next to shared
memory on one host, in µs.

Shard processes (`moesplit expert-server`, a tiny bf16 checkpoint holding every expert, kernels
backend), all started by this script:

  tcp_c      on host "shard", --shm-dir '': the TCP data path in C on both ends (the GPU side's C client,
             gpu_service/experts/tcp_client.c; the shard's C loop, kernels/moe_tcp.c);
  tcp_pyclient  the same shard, the GPU side's Python code for the frames (TcpPath without its C client);
  tcp_c_raw  tcp_c's C client alone (send, wait, read; no futures, no routing): the protocol's floor;
  tcp_py     on host "shard", MOESPLIT_TCP_LOOP=python, the GPU side's Python code: the TCP data path
             as it was in Python on both ends;
  tcp_tls    on host "shard", --tls-cert/--tls-key/--tls-ca (a CA, shard and client certificates made
             here, as tests/test_tls.py makes them): gRPC and the data path mutual TLS, the data path
             in C on both ends (wire/tcp_io.c over OpenSSL; asserted: the client's link is TLS);
  tcp_tls_py the same TLS files, MOESPLIT_TCP_LOOP=python on the shard and the GPU side's Python code
             (Python's ssl): the TLS data path as it was;
  tcp_c_1ms  tcp_c through the fault proxy (tests/nethosts.FaultProxy, user-space threads on the GPU
             host) adding 0.5 ms each way (1 ms a round trip), and tcp_c_proxy through it with none:
             the proxy's own cost, to subtract;
  shm        on host "gpu" itself (shared memory: same host).

The GPU side runs as a separate process inside host "gpu" (`ip netns exec`; nothing here talks to
the test addresses from the host's own network) and times, interleaved in rounds,
RemoteExperts(client)(layer, h, ids, w).wait() (bench_handoff's "remote": what the model calls) at
batch 1 and 8 for each variant, --runs times (each run all rounds; "variants" holds the median over
runs of each run's median, "runs" each run's medians). Needs root and iproute2. Prints JSON; --out
FILE writes it too.

    python bench/bench_tcp_hosts.py [--calls 1000] [--rounds 5] [--runs 3]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from cpu_expert_service.probes import cpu_description  # noqa: E402

LAYERS_BOUND = 58  # MoE layers of DeepSeek-V3 / Kimi-K2: the per-token bound a link's round trip implies
RAW_SEQ = itertools.count()
SHARDS = {"tcp_c": (50051, {}), "tcp_py": (50052, {"MOESPLIT_TCP_LOOP": "python"}), "tcp_tls": (50053, {}),
          "tcp_tls_py": (50054, {"MOESPLIT_TCP_LOOP": "python"})}


def client(args) -> dict:
    """The GPU side (run inside host "gpu"): time every variant's round trips."""
    from bench_handoff import BATCHES, inputs, stats, time_remote
    from checkpoint.config import load_config
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.handoff import RemoteExperts
    from nethosts import FaultProxy

    from gpu_service.experts import tcp as tcpmod
    from wire.channel import TLSFiles

    cfg = load_config(args.model)
    layer = cfg.moe_layers[0]
    targets = json.loads(args.targets)  # variant -> (address, transport[, TLS files: cert, key, ca])
    proxy = None
    if "tcp_c_proxy" in targets:
        host, port = targets["tcp_c"][0].rsplit(":", 1)
        me = targets["tcp_c_proxy"][0].rsplit(":", 1)[0]
        # the proxy forwards both the gRPC port and the data port (AttachTcp's port, the shard's data port)
        proxy = [FaultProxy(args.ns, (me, p), (host, p), seed=p).start() for p in (int(port), int(port) + 10)]
    clients, experts = {}, {}
    try:
        for v, (addr, transport, *tls) in targets.items():
            if v == "tcp_c_1ms":
                continue  # the same proxy, with latency: timed in its own phase
            tls = TLSFiles(*tls[0]) if tls else None
            built, tcpmod._C = tcpmod._C, (None if v == "tcp_tls_py" else tcpmod._C)  # tcp_tls_py: Python's ssl
            try:
                c = ExpertsClient([addr], cfg, transport=transport, wire_dtype="bfloat16", timeout_s=30, tls=tls,
                                  tls_server_name="localhost" if tls else None).connect()
            finally:
                tcpmod._C = built
            assert c.fast.transport_of(addr) == transport, (v, c.fast.reasons)
            if v == "tcp_tls_py":
                assert c.fast.paths[addr][0].c is None, c.fast.paths[addr][0].describe()
            elif v in ("tcp_pyclient", "tcp_py"):  # frames sent and received by TcpPath's Python code
                c.fast.paths[addr][0].c = None
            elif transport == "tcp":
                assert c.fast.paths[addr][0].c is not None, f"{v}: the C client is not built"
                assert c.fast.paths[addr][0].c.link.tls == (tls is not None), (v, c.fast.paths[addr][0].describe())
            clients[v], experts[v] = c, RemoteExperts(c)
        times = {(v, B): [] for v in (*targets, "tcp_c_raw") for B in BATCHES}
        raw = clients["tcp_c"].fast.paths[targets["tcp_c"][0]][0]  # tcp_c's own connection, idle between calls
        for B in BATCHES:  # warm-up
            h, ids, w = inputs(cfg, B, B)
            for e in experts.values():
                time_remote(e, layer, h, ids, w, 100)
        per = max(1, args.calls // args.rounds)
        for r in range(args.rounds):
            for B in BATCHES:
                h, ids, w = inputs(cfg, B, 100 * r + B)
                order = list(experts) if r % 2 == 0 else list(experts)[::-1]
                for v in order:
                    times[(v, B)] += time_remote(experts[v], layer, h, ids, w, per)
                times[("tcp_c_raw", B)] += time_c_raw(raw, layer, h, ids, w, per)
        if proxy is not None:  # 0.5 ms each way on the proxied link
            for px in proxy:
                px.latency_s = 0.0005
            for B in BATCHES:
                h, ids, w = inputs(cfg, B, B)
                time_remote(experts["tcp_c_proxy"], layer, h, ids, w, 20)
                times[("tcp_c_1ms", B)] += time_remote(experts["tcp_c_proxy"], layer, h, ids, w,
                                                       max(50, args.calls // 10))
    finally:
        for c in clients.values():
            c.close()
        for px in proxy or ():
            px.close()
    out = {}
    for (v, B), xs in times.items():
        out.setdefault(v, {})[f"b{B}"] = stats(xs)
    return out


def time_c_raw(fp, layer, h, ids, w, n: int) -> list[float]:
    """Round trips through the C client alone (send, wait, read on tcp_c's idle connection; sequence
    numbers apart from its own): the protocol's floor from this side."""
    from gpu_service.experts.handoff import _numpy

    x, i, ww = _numpy(h.contiguous()), ids.numpy().astype(np.int64), w.numpy().astype(np.float32)
    assert not fp.pending, "the data connection has calls in flight"
    out, clock = [], time.perf_counter_ns
    for s in range(n):
        seq = (1 << 40) + next(RAW_SEQ)
        t0 = clock()
        fp.c.send(seq, layer, x, i, ww, 10_000)
        head = fp.c.wait(fp.spin_ns, time.monotonic_ns() + 10_000_000_000, 10**9)
        y = fp.c.read(x.shape[0])
        out.append((clock() - t0) / 1e3)
        assert head is not None and head[0] == seq and head[1] == 0 and y.shape == x.shape, head
    return out


def make_pki(work: str) -> dict:
    """A CA, a shard certificate (for localhost) and a GPU-service client certificate in work, made as
    tests/test_tls.py makes them: {"ca": path, "server": {cert, key}, "client": {cert, key}}."""
    from test_tls import _ca, _leaf, _write

    ca = _ca("moesplit bench CA")
    return {"ca": _write(work, "ca", None, ca[1])["cert"],
            "server": _write(work, "server", *_leaf(ca, "expert-shard", server=True, client=False)),
            "client": _write(work, "client", *_leaf(ca, "gpu-service", server=False, client=True))}


def orchestrate(args) -> dict:
    """Hosts, shards and the client process; the record."""
    from bench_handoff import tiny
    from checkpoint.config import load_config
    from nethosts import NetHosts, skip_reason
    from netstack import GRPC_PORT, env

    why = skip_reason()
    if why is not None:
        raise SystemExit(f"bench_tcp_hosts: {why}")
    model = tiny()
    cfg = load_config(model)
    work = tempfile.mkdtemp(prefix="tcp-hosts-")
    pki = make_pki(work)
    with NetHosts(["gpu", "shard"]) as net:
        procs = []
        spin = {"MOESPLIT_SHM_SPIN_US": f"{args.spin_us:g}"}
        os.environ.update(spin)  # the client process's too
        for v, (port, extra) in SHARDS.items():
            tls = ["--tls-cert", pki["server"]["cert"], "--tls-key", pki["server"]["key"], "--tls-ca", pki["ca"]] \
                if v.startswith("tcp_tls") else []
            procs.append(net.popen("shard", [sys.executable, "-m", "moesplit", "expert-server", "--model", model,
                                             "--host", net.addr["shard"], "--port", str(port), "--data-port",
                                             str(port + 10), "--port-file", f"{work}/{v}.port", "--backend", "auto",
                                             "--shm-dir", "", "--shard-id", v, *tls],
                                   env={**env(), **spin, **extra}, stdout=subprocess.DEVNULL,
                                   stderr=open(f"{work}/{v}.log", "wb"), cwd=ROOT))
        procs.append(net.popen("gpu", [sys.executable, "-m", "moesplit", "expert-server", "--model", model,
                                       "--host", "127.0.0.1", "--port", str(GRPC_PORT + 2), "--port-file",
                                       f"{work}/shm.port", "--backend", "auto", "--shard-id", "shm"],
                               env={**env(), **spin}, stdout=subprocess.DEVNULL, stderr=open(f"{work}/shm.log", "wb"),
                               cwd=ROOT))
        end = time.monotonic() + 300
        while not all(os.path.exists(f"{work}/{v}.port") for v in (*SHARDS, "shm")):
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                raise SystemExit(f"bench_tcp_hosts: the shards did not start; logs in {work}")
            time.sleep(0.2)
        shard = net.addr["shard"]
        targets = {"shm": (f"127.0.0.1:{GRPC_PORT + 2}", "shm"), "tcp_c": (f"{shard}:50051", "tcp"),
                   "tcp_pyclient": (f"{shard}:50051", "tcp"), "tcp_py": (f"{shard}:50052", "tcp"),
                   "tcp_c_proxy": (f"{net.addr['gpu']}:50051", "tcp"), "tcp_c_1ms": (f"{net.addr['gpu']}:50051", "tcp"),
                   "tcp_tls": (f"{shard}:50053", "tcp", [pki["client"]["cert"], pki["client"]["key"], pki["ca"]]),
                   "tcp_tls_py": (f"{shard}:50054", "tcp", [pki["client"]["cert"], pki["client"]["key"], pki["ca"]])}
        runs = []
        for _ in range(args.runs):
            r = net.run("gpu", [sys.executable, os.path.abspath(__file__), "--client", "--model", model, "--targets",
                                json.dumps(targets), "--ns", net.ns["gpu"], "--calls", str(args.calls), "--rounds",
                                str(args.rounds)], timeout=1200)
            if r.returncode != 0:
                raise SystemExit(f"bench_tcp_hosts: the client failed:\n{r.stderr[-4000:]}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    res = {v: {b: {"median_us": round(float(np.median([x[v][b]["median_us"] for x in runs])), 1),
                   "p90_us": round(float(np.median([x[v][b]["p90_us"] for x in runs])), 1),
                   "calls": sum(x[v][b]["calls"] for x in runs)} for b in runs[0][v]} for v in runs[0]}
    per_token = {f"b{B}": round(LAYERS_BOUND * res["tcp_c_1ms"][f"b{B}"]["median_us"] / 1e3, 1) for B in (1, 8)}
    return {
        "definition": __doc__,
        "cpu": cpu_description(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "spin_us": args.spin_us,
        "hidden_size": cfg.hidden_size, "top_k": cfg.num_experts_per_tok, "wire_dtype": "bfloat16",
        "runs": len(runs), "variants": res,
        "run_medians_us": {v: {b: [x[v][b]["median_us"] for x in runs] for b in ("b1", "b8")} for v in res},
        "ratio_tcp_c_to_shm": {b: round(res["tcp_c"][b]["median_us"] / res["shm"][b]["median_us"], 2)
                               for b in ("b1", "b8")},
        "ratio_tcp_tls_to_shm": {b: round(res["tcp_tls"][b]["median_us"] / res["shm"][b]["median_us"], 2)
                                 for b in ("b1", "b8")},
        "ratio_tcp_tls_to_tcp_c": {b: round(res["tcp_tls"][b]["median_us"] / res["tcp_c"][b]["median_us"], 2)
                                   for b in ("b1", "b8")},
        "ratio_tcp_tls_py_to_tcp_tls": {b: round(res["tcp_tls_py"][b]["median_us"] / res["tcp_tls"][b]["median_us"], 2)
                                        for b in ("b1", "b8")},
        "ratio_tcp_py_to_tcp_c": {b: round(res["tcp_py"][b]["median_us"] / res["tcp_c"][b]["median_us"], 2)
                                  for b in ("b1", "b8")},
        "ratio_tcp_pyclient_to_tcp_c": {b: round(res["tcp_pyclient"][b]["median_us"] / res["tcp_c"][b]["median_us"], 2)
                                        for b in ("b1", "b8")},
        "per_token_ms_at_1ms_for_58_moe_layers": per_token,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="timed calls per variant and batch (default 1000)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds the calls are split into")
    p.add_argument("--runs", type=int, default=3, help="client runs (medians over them; default 3)")
    p.add_argument("--spin-us", type=float, default=200.0, help="MOESPLIT_SHM_SPIN_US for both sides")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the GPU side, inside host "gpu"
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--targets", help=argparse.SUPPRESS)
    p.add_argument("--ns", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.client:
        print(json.dumps(client(a)))
        return 0
    text = json.dumps(orchestrate(a), indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
