"""The real product on test hosts (tests/nethosts.py): `moesplit expert-server` replicas and a
`moesplit gpu-server` each started in its own namespace, and completions asked from inside the
GPU host's namespace (never from the host's own network: 10.77.x routes off the machine there).

    shard = start_shard(net, "r0", work, model_dir, ["--experts", "0-7"])
    gpu = start_gpu(net, work, model_dir, [f"{net.addr['r0']}:{GRPC_PORT}", ...], ["--max-batch", "8"])
    ids, text = stream(net, gpu.url, prompt, 96, on_chunk)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from nethosts import skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-net"
GRPC_PORT, DATA_PORT, HTTP_PORT = 50051, 50061, 8000


# Fixtures of the namespace test modules: `from netstack import model_dir, need_namespaces  # noqa: F401`.
@pytest.fixture(scope="module", autouse=True)
def need_namespaces():
    """Skip the module, with the reason, where namespaces cannot be made."""
    why = skip_reason()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    """A tiny bf16 checkpoint (16 routed experts, 2 MoE layers) for the module; seed: the module's
    MODEL_SEED."""
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("net") / MODEL), "bf16", seed=request.module.MODEL_SEED)


def env() -> dict:
    """The environment of the started processes: this checkout on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@dataclass
class Proc:
    """A started server: its process, command (without `ip netns exec NS`), log and port file."""
    host: str
    p: subprocess.Popen
    cmd: list[str]
    log: str
    port_file: str
    url: str = ""
    restarts: list = field(default_factory=list)

    def exited(self) -> str | None:
        """None while it runs; else its exit status and the tail of its log."""
        if self.p.poll() is None:
            return None
        with open(self.log, errors="replace") as f:
            return f"{self.host} exited {self.p.returncode}:\n{f.read()[-3000:]}"


def wait(pred, timeout: float, what: str, procs=()):
    """Poll pred() until true; fails naming `what`, or with the log of a Proc in procs that died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pr in procs:
            why = pr.exited()
            if why:
                raise AssertionError(f"{what}: {why}")
        try:
            if pred():
                return
        except (OSError, httpx.TransportError, TimeoutError):  # not listening yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_shard(net, host: str, work, model_dir: str, extra: list[str] = ()) -> Proc:
    """`moesplit expert-server` on host's address (gRPC GRPC_PORT, data DATA_PORT, no shared memory:
    the TCP data path, as a remote host). Returns at once; wait for `port_file` to exist."""
    log, port_file = str(work / f"{host}.log"), str(work / f"{host}.port")
    cmd = [sys.executable, "-m", "moesplit", "expert-server", "--model", model_dir, "--host", net.addr[host],
           "--port", str(GRPC_PORT), "--data-port", str(DATA_PORT), "--port-file", port_file, "--shard-id", host,
           "--backend", "auto", "--shm-dir", "", *extra]
    with open(log, "ab") as err:
        p = net.popen(host, cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(), cwd=ROOT)
    return Proc(host, p, cmd, log, port_file)


def restart(net, pr: Proc) -> Proc:
    """pr's command started again on its host (same address and ports, a new process)."""
    if os.path.exists(pr.port_file):
        os.remove(pr.port_file)
    with open(pr.log, "ab") as err:
        pr.p = net.popen(pr.host, pr.cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(), cwd=ROOT)
    pr.restarts.append(time.monotonic())
    return pr


def start_gpu(net, work, model_dir: str, shards: list[str], extra: list[str] = (), host: str = "gpu") -> Proc:
    """`moesplit gpu-server` on host's address, CPU float32, with the given shard addresses
    (replicas of a group: same experts); waits until /health answers 200."""
    log = str(work / f"{host}.log")
    cmd = [sys.executable, "-m", "moesplit", "gpu-server", "--model", model_dir, "--shards-addresses",
           ",".join(shards), "--host", net.addr[host], "--port", str(HTTP_PORT), "--grpc-port", "50050",
           "--device", "cpu", "--dtype", "float32", "--page-size", "16", "--chunk-tokens", "256",
           "--served-model-name", MODEL, *extra]
    with open(log, "wb") as err:
        p = net.popen(host, cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(), cwd=ROOT)
    pr = Proc(host, p, cmd, log, "", url=f"http://{net.addr[host]}:{HTTP_PORT}")
    wait(lambda: get(net, pr.url, "/health").status_code == 200, 120, "the GPU service", [pr])
    return pr


def get(net, url: str, path: str, host: str = "gpu"):
    """GET url+path from inside host's namespace."""
    return net.call_in(host, lambda: httpx.get(url + path, timeout=5), timeout=10)


def shard_status(net, url: str) -> dict:
    """{address: status} of the GPU service's /health (its experts client's view of each replica)."""
    return get(net, url, "/health").json()["shards"]


def all_serving(net, url: str) -> bool:
    """Every replica SERVING in the GPU service's view."""
    return set(shard_status(net, url).values()) == {"SERVING"}


def complete(net, url: str, prompt: list[int], n: int, timeout: float = 60) -> list[int]:
    """Greedy completion of `prompt` (token ids) from inside the GPU namespace; its token ids."""
    def go():
        return httpx.post(url + "/v1/completions", timeout=timeout, json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})

    r = net.call_in("gpu", go, timeout=timeout + 5)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def stream_in_ns(url: str, prompt: list[int], n: int, on_chunk=None, timeout: float = 60) -> tuple[list[int], str]:
    """A greedy streamed completion (call from a thread inside the GPU namespace): its token ids and
    text; on_chunk(k) after the k-th chunk. An error chunk or a non-200 fails."""
    ids, text, k = [], [], 0
    with httpx.stream("POST", url + "/v1/completions", timeout=timeout, json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}) as resp:
        assert resp.status_code == 200, resp.read()[:2000]
        for ln in resp.iter_lines():
            if not ln.startswith("data: ") or ln == "data: [DONE]":
                continue
            ch = json.loads(ln[len("data: "):])
            assert "error" not in ch, ch
            ids += ch["choices"][0].get("token_ids") or []
            text.append(ch["choices"][0].get("text") or "")
            k += 1
            if on_chunk is not None:
                on_chunk(k)
    return ids, "".join(text)


def stream(net, url: str, prompt: list[int], n: int, on_chunk=None, timeout: float = 60) -> tuple[list[int], str]:
    """stream_in_ns from a thread inside the GPU namespace."""
    return net.call_in("gpu", lambda: stream_in_ns(url, prompt, n, on_chunk, timeout), timeout=timeout + 5)


def metrics(net, url: str) -> dict[tuple[str, frozenset], float]:
    """The GPU service's /metrics (from its namespace) as {(name, {label: value} items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(get(net, url, "/metrics").text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(m: dict, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0.0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)
