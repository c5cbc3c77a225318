"""Expert shards on other hosts, tested as other hosts: the GPU service (`moesplit gpu-server`) in
one network namespace, 2 replicas of the same experts (`moesplit expert-server`) in two others,
each with its own address on a private bridge (tests/nethosts.py); replica r1 is reached through
a fault proxy in the GPU host's namespace. The shards refuse shared memory (--shm-dir ''), so the
GPU service talks to them over gRPC and the TCP data path, as to a remote host.

Greedy tokens are compared with the same prompt run over loopback (`moesplit generate`): fault
free, with one replica partitioned mid-stream (its veth down), with 20 ms + jitter on one link,
and with a half-open link (the proxy holds every byte and closes nothing) found by the deadline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from nethosts import FaultProxy, NetHosts
from netstack import (DATA_PORT, GRPC_PORT, MODEL, ROOT, all_serving, complete, metrics, restart, sample, shard_status,
                      start_gpu, start_shard, stream, wait)
from netstack import model_dir, need_namespaces  # noqa: F401 - the module's checkpoint; skipped without namespaces

N_TOK = 16
TIMEOUT_S = 3.0  # --expert-timeout of the GPU service
MAX_BATCH, MAX_WAITING = 4, 4  # the GPU service's running batch and queue bound
MODEL_SEED = 5  # model_dir's


def _prompt(i: int) -> list[int]:
    """Prompt i as token ids (different lengths)."""
    return [5 + (7 * i + 3 * k) % 90 for k in range(6 + i)]


@pytest.fixture(scope="module")
def loopback(model_dir):
    """Greedy tokens of prompts 0 and 1 over loopback (`moesplit generate`, 1 local shard each, run together)."""
    procs = [subprocess.Popen([sys.executable, "-m", "moesplit", "generate", "--model", model_dir, "--prompt-ids",
                               ",".join(map(str, _prompt(i))), "--max-new-tokens", str(N_TOK), "--shards", "1",
                               "--backend", "auto", "--device", "cpu", "--dtype", "float32", "--ignore-eos",
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(2)]
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=120)
            assert p.returncode == 0, se[-2000:]
            out.append(json.loads(so.strip().splitlines()[-1])["token_ids"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert out[0] != out[1]  # different prompts: the comparisons below can tell them apart
    return out


@pytest.fixture(scope="module")
def hosts(model_dir, tmp_path_factory):
    """gpu (10.77.0.1), r0 (.2), r1 (.3); the GPU service's shards: r0 direct, r1 via the proxy."""
    work = tmp_path_factory.mktemp("nethosts")
    with NetHosts(["gpu", "r0", "r1"]) as net:
        net.shards = {h: start_shard(net, h, work, model_dir) for h in ("r0", "r1")}
        wait(lambda: all(os.path.exists(s.port_file) for s in net.shards.values()), 120, "the shards",
             net.shards.values())
        gpu = net.addr["gpu"]
        proxies = [FaultProxy(net.ns["gpu"], (gpu, port), (net.addr["r1"], port), seed=port).start()
                   for port in (GRPC_PORT, DATA_PORT)]
        try:
            net.gpu = start_gpu(net, work, model_dir, [f"{net.addr['r0']}:{GRPC_PORT}", f"{gpu}:{GRPC_PORT}"],
                                ["--kv-tokens", "1024", "--max-batch", str(MAX_BATCH), "--max-waiting", str(MAX_WAITING),
                                 "--expert-timeout", str(TIMEOUT_S)])
            net.url, net.proxies, net.logs = net.gpu.url, proxies, {"gpu": net.gpu.log}
            yield net
        finally:
            for px in proxies:
                px.close()


def _complete(net, i, timeout=60):
    """Greedy completion of prompt i from inside the GPU namespace; its token ids."""
    return complete(net, net.url, _prompt(i), N_TOK, timeout)


def _stream(net, i, on_chunk, timeout=60):
    """Streamed completion of prompt i; on_chunk(k) after the k-th chunk. Its token ids."""
    return stream(net, net.url, _prompt(i), N_TOK, on_chunk, timeout)[0]


def _shard_status(net) -> dict:
    """{address: status} of the GPU service's /health."""
    return shard_status(net, net.url)


def _replicas_healthy(net):
    """Every replica SERVING in the GPU service's view."""
    return all_serving(net, net.url)


def test_fault_free_equals_loopback(hosts, loopback):
    """Two hosts' replicas, gRPC + TCP data path: the greedy tokens of the loopback run."""
    for i in range(2):
        assert _complete(hosts, i) == loopback[i]
    assert all(px.forwarded > 0 for px in hosts.proxies)  # replica r1 served calls through the proxy, both ports
    with open(hosts.logs["gpu"], errors="replace") as f:
        log = f.read()
    for addr in (f"{hosts.addr['r0']}:{GRPC_PORT}", f"{hosts.addr['gpu']}:{GRPC_PORT}"):  # no shared memory
        assert f"expert shard {addr}: TCP data path" in log, log[-3000:]


def test_partition_mid_stream(hosts, loopback):
    """r0's veth taken down after the first streamed chunk (r1's link slowed by 20 ms so the stream
    is still decoding): the stream completes with the loopback tokens; r0 is reported down."""
    wait(lambda: _replicas_healthy(hosts), 30, "both replicas healthy")
    r0 = f"{hosts.addr['r0']}:{GRPC_PORT}"
    t, seen = {}, []

    def cut(k):
        seen.append(k)
        if k == 1:
            hosts.partition("r0")
            t["cut"] = time.monotonic()

    for px in hosts.proxies:
        px.latency_s = 0.020
    try:
        got = _stream(hosts, 1, cut)
        took = time.monotonic() - t["cut"]
        wait(lambda: _shard_status(hosts)[r0] != "SERVING", 2 * TIMEOUT_S + 2, "r0 reported down")
    finally:
        for px in hosts.proxies:
            px.latency_s = 0.0
        hosts.heal("r0")
    assert got == loopback[1]
    assert len(seen) > 2  # chunks kept coming after the partition
    assert took < 3 * TIMEOUT_S + 5, took  # one deadline to notice, then the other replica
    print(f"\npartition: stream completed {took:.2f}s after r0's link went down")
    wait(lambda: _replicas_healthy(hosts), 30, "r0 back after healing")
    assert _complete(hosts, 0) == loopback[0]


def test_latency_on_one_link(hosts, loopback):
    """20 ms + up to 5 ms jitter per forwarded chunk on r1's link: same tokens."""
    for px in hosts.proxies:
        px.latency_s, px.jitter_s = 0.020, 0.005
    n0 = sum(px.forwarded for px in hosts.proxies)
    try:
        t0 = time.monotonic()
        got = [_complete(hosts, i) for i in (1, 0)]
        took = time.monotonic() - t0
    finally:
        for px in hosts.proxies:
            px.latency_s = px.jitter_s = 0.0
    assert got == [loopback[1], loopback[0]]
    assert sum(px.forwarded for px in hosts.proxies) > n0  # the slow link carried calls
    print(f"\n20 ms link: 2 completions in {took:.2f}s")


def test_bandwidth_cap_and_reset(hosts, loopback):
    """A 2 MB/s cap, then every proxied connection reset mid-stream: same tokens."""
    for px in hosts.proxies:
        px.rate_bps = 2_000_000

    def rst(k):
        if k == 2:
            for px in hosts.proxies:
                px.reset()

    try:
        got = _stream(hosts, 1, rst)
    finally:
        for px in hosts.proxies:
            px.rate_bps = 0
    assert got == loopback[1]


def test_replica_killed_and_restarted(hosts, loopback):
    """kill -9 of r0 after the first streamed chunk: same tokens; r0 started again on its host and
    port (a new process) rejoins without a restart of the GPU service."""
    wait(lambda: _replicas_healthy(hosts), 30, "both replicas healthy")
    r0p = hosts.shards["r0"]
    p = r0p.p
    r0 = f"{hosts.addr['r0']}:{GRPC_PORT}"

    def kill(k):
        if k == 1:
            p.kill()
            p.wait()

    got = _stream(hosts, 1, kill)
    assert got == loopback[1] and p.returncode is not None
    wait(lambda: _shard_status(hosts)[r0] != "SERVING", TIMEOUT_S + 2, "r0 reported down")
    restart(hosts, r0p)
    t0 = r0p.restarts[-1]
    wait(lambda: os.path.exists(r0p.port_file), 60, "r0 restarted", [r0p])
    wait(lambda: _replicas_healthy(hosts), 30, "r0 to rejoin")
    rejoined = time.monotonic() - t0
    assert _complete(hosts, 0) == loopback[0]
    print(f"\nrestart: r0 serving again and used {rejoined:.2f}s after its new process started")


def test_half_open_link_found_by_deadline(hosts, loopback):
    """r1's link holds every byte and closes nothing (from the first streamed chunk on): the stream
    completes with the loopback tokens, r1 is reported down within the expert deadline (not TCP
    keep-alive, minutes), and a request sent while the link hangs completes in bounded time."""
    wait(lambda: _replicas_healthy(hosts), 30, "both replicas healthy")
    r1 = f"{hosts.addr['gpu']}:{GRPC_PORT}"  # r1 as the GPU service knows it: the proxy
    t = {}

    def hang(k):
        if k == 1:
            for px in hosts.proxies:
                px.half_open = True
            t["hang"] = time.monotonic()

    try:
        got = _stream(hosts, 0, hang)
        wait(lambda: _shard_status(hosts)[r1] != "SERVING", TIMEOUT_S + 2, "r1 reported down")
        noticed = time.monotonic() - t["hang"]
        t0 = time.monotonic()
        again = _complete(hosts, 1, timeout=30)
        took = time.monotonic() - t0
    finally:
        for px in hosts.proxies:
            px.half_open = False
            px.reset()
    assert got == loopback[0] and again == loopback[1]
    assert noticed < 2 * TIMEOUT_S + 3, noticed
    assert took < TIMEOUT_S + 10, took
    print(f"\nhalf-open: r1 reported down {noticed:.2f}s after its link stopped forwarding; "
          f"a request during the hang took {took:.2f}s")
    wait(lambda: _replicas_healthy(hosts), 30, "r1 back once the link forwards again")


def _burst(net, n: int) -> list[tuple[int, float, str]]:
    """n completions of prompt 0 sent at once from the GPU namespace: (status, seconds, Retry-After)."""
    import httpx

    def one():
        t0 = time.monotonic()
        r = httpx.post(net.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": _prompt(0), "max_tokens": N_TOK, "temperature": 0, "ignore_eos": True})
        return r.status_code, time.monotonic() - t0, r.headers.get("retry-after", "")

    def all_at_once():
        from concurrent.futures import ThreadPoolExecutor  # its threads are started here: in the namespace

        with ThreadPoolExecutor(n) as ex:
            return list(ex.map(lambda _: one(), range(n)))

    return net.call_in("gpu", all_at_once, timeout=90)


def test_slow_replica_metrics_and_back_pressure(hosts, loopback):
    """20 ms + 5 ms jitter on r1's link: moesplit_expert_call_seconds names r1 by its shard id and
    the host the GPU service dials (the proxy's) and shows its calls slower than r0's; a burst of
    MAX_BATCH + MAX_WAITING + 4 requests while the steps wait for r1: those over the queue bound get
    429 with Retry-After at once (the queue does not grow with the slow shard), the others complete."""
    wait(lambda: _replicas_healthy(hosts), 30, "both replicas healthy")
    before = metrics(hosts, hosts.url)
    ups = {dict(ls)["replica"]: (dict(ls)["host"], v) for (n, ls), v in before.items() if n == "moesplit_expert_shard_up"}
    assert ups == {"r0": (hosts.addr["r0"], 1.0), "r1": (hosts.addr["gpu"], 1.0)}, ups  # r1: through the proxy
    for px in hosts.proxies:
        px.latency_s, px.jitter_s = 0.020, 0.005
    try:
        t0 = time.monotonic()
        assert _complete(hosts, 0) == loopback[0]
        slow = time.monotonic() - t0
        after = metrics(hosts, hosts.url)
        burst = _burst(hosts, MAX_BATCH + MAX_WAITING + 4)
    finally:
        for px in hosts.proxies:
            px.latency_s = px.jitter_s = 0.0
    t0 = time.monotonic()
    assert _complete(hosts, 0) == loopback[0]
    fast = time.monotonic() - t0
    mean = {}
    for h, host in (("r0", hosts.addr["r0"]), ("r1", hosts.addr["gpu"])):
        n = (sample(after, "moesplit_expert_call_seconds_count", host=host, replica=h)
             - sample(before, "moesplit_expert_call_seconds_count", host=host, replica=h))
        assert n > 0, h  # both replicas of the group take calls (round-robin)
        mean[h] = (sample(after, "moesplit_expert_call_seconds_sum", host=host, replica=h)
                   - sample(before, "moesplit_expert_call_seconds_sum", host=host, replica=h)) / n
    assert mean["r1"] >= 0.040 > 0.010 > mean["r0"], mean  # 20 ms each way through the proxy
    codes = sorted(c for c, _, _ in burst)
    refused = [(t, ra) for c, t, ra in burst if c == 429]
    # at most MAX_WAITING wait; those the engine admitted to the running batch meanwhile (up to MAX_BATCH) are
    # not counted, so MAX_WAITING to MAX_BATCH + MAX_WAITING are served, the rest refused
    assert MAX_WAITING <= codes.count(200) <= MAX_BATCH + MAX_WAITING and set(codes) <= {200, 429}, codes
    assert refused and all(ra.isdigit() and t < 1.0 for t, ra in refused), refused
    served = sorted(t for c, t, _ in burst if c == 200)
    print(f"\nslow replica: mean call r1 {mean['r1'] * 1e3:.1f} ms, r0 {mean['r0'] * 1e3:.1f} ms; "
          f"{N_TOK} tokens {slow:.2f}s (link healed: {fast:.2f}s); burst of {len(burst)}: {codes.count(200)} served "
          f"in {served[0]:.2f}-{served[-1]:.2f}s, {len(refused)} refused (429) in <= {max(t for t, _ in refused):.3f}s")
