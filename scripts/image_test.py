"""End-to-end check of the built images (`make image-test`, after scripts/build_images.sh).

A tiny checkpoint (`moesplit make-tiny`, files as it wrote them with the caller's umask) mounted read-only,
first read file by file by the experts image's non-root user; 2 expert shard containers from
moesplit-experts and one GPU-service container from the CPU moesplit-gpu, all on the host network;
the official `openai` client must get the same greedy completion as the same processes run on the
host (no container). Then: `podman stop` of a shard ends it within 10 s with exit status 0, the GPU
service reports /health 503 while /live stays 200, and /health is 200 again after `podman start`.
Also: moesplit-experts has no torch, is under 600 MB, runs as a non-root user, and its kernels
report the host's ISA (moesplit_expert_backend_info). Prints the shard start-to-SERVING time.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PODMAN_RUN = os.environ.get("PODMAN_RUN_FLAGS", "--runtime runc --network=host "
                            "--ulimit nofile=1024:1024 --ulimit nproc=1000:1000").split()
PREFIX = "moesplit-image-test"
PROMPT = "The capital of France is"
MAX_TOKENS = 16
MAX_EXPERTS_MB = 600


def names() -> tuple[str, str]:
    out = subprocess.run([os.path.join(ROOT, "scripts", "build_images.sh"), "names"], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], out[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def podman(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], check=check, capture_output=True, text=True, **kw)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_for(pred, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def backend_info(metrics_port: int) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    m = re.search(r"^moesplit_expert_backend_info\{([^}]*)\}", body, re.M)
    assert m, "no moesplit_expert_backend_info in /metrics"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    labels.pop("shard_id", None)
    return labels


def complete(http_port: int, model: str) -> str:
    client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


def shard_args(model: str, n_experts: int, i: int, port: int, mport: int) -> list[str]:
    half = n_experts // 2
    lo, hi = (0, half - 1) if i == 0 else (half, n_experts - 1)
    return ["expert-server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--experts", f"{lo}-{hi}", "--shard-id", f"shard{i}", "--metrics-port", str(mport)]


def gpu_args(model: str, http: int, grpc_port: int, shards: list[int]) -> list[str]:
    return ["gpu-server", "--model", model, "--host", "127.0.0.1", "--port", str(http),
            "--grpc-port", str(grpc_port), "--device", "cpu", "--served-model-name", "tiny",
            "--shards-addresses", ",".join(f"127.0.0.1:{p}" for p in shards)]


def local_run(moesplit: list[str], model: str, n_experts: int) -> tuple[str, dict]:
    """The reference: the same three processes on the host, no container."""
    ports, mports = [free_port(), free_port()], [free_port(), free_port()]
    http = free_port()
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen([*moesplit, *shard_args(model, n_experts, i, ports[i], mports[i])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in ports:
            wait_for(lambda: serving(p), 120, f"local shard :{p}")
        procs.append(subprocess.Popen([*moesplit, *gpu_args(model, http, free_port(), ports)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(lambda: http_status(f"http://127.0.0.1:{http}/health") == 200, 180, "local GPU service /health")
        return complete(http, "tiny"), backend_info(mports[0])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    experts_img, gpu_img = names()
    # This checkout's code (the venv may hold an editable install of another one): python -m moesplit from ROOT.
    moesplit = [sys.executable, "-m", "moesplit"]
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    work = tempfile.mkdtemp(prefix="moesplit-image-test-")
    os.chmod(work, 0o755)
    model = os.path.join(work, "tiny")
    # written with this session's umask and left as make-tiny wrote it: the images' non-root user must read it
    subprocess.run([*moesplit, "make-tiny", model], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(model, "config.json")) as f:
        n_experts = int(json.load(f)["n_routed_experts"])
    cmodel = "/models/tiny"
    mount = ["-v", f"{model}:{cmodel}:ro"]
    failures: list[str] = []

    def check(ok: bool, msg: str) -> None:
        print(("ok    " if ok else "FAIL  ") + msg, flush=True)
        if not ok:
            failures.append(msg)

    # Static properties of the images.
    for img in (experts_img, gpu_img):
        user = podman("image", "inspect", "--format", "{{.Config.User}}", img).stdout.strip()
        uid = podman("run", "--rm", *PODMAN_RUN, "--entrypoint", "id", img, "-u").stdout.strip()
        check(user not in ("", "0", "root") and uid not in ("", "0"), f"{img} runs as non-root (USER {user}, uid {uid})")
    size_mb = int(podman("image", "inspect", "--format", "{{.Size}}", experts_img).stdout) / 1e6
    check(size_mb < MAX_EXPERTS_MB, f"{experts_img} is {size_mb:.0f} MB (< {MAX_EXPERTS_MB} MB)")
    r = podman("run", "--rm", *PODMAN_RUN, "--entrypoint", "python", experts_img, "-c", "import torch", check=False)
    check(r.returncode != 0 and "No module named 'torch'" in r.stderr, f"{experts_img}: `import torch` fails")
    r = podman("run", "--rm", *PODMAN_RUN, "--entrypoint", "python", experts_img, "-c",
               "import moesplit.cli, wire, checkpoint, cpu_expert_service.server, protos, importlib.util as u; "
               "import cpu_expert_service.kernels._moe; print(u.find_spec('gpu_service'))", check=False)
    check(r.returncode == 0 and r.stdout.strip() == "None",
          f"{experts_img}: moesplit, wire, checkpoint, cpu_expert_service, protos; no gpu_service "
          f"({(r.stdout + r.stderr).strip()[-200:]})")
    r = podman("run", "--rm", *PODMAN_RUN, "--entrypoint", "python", gpu_img, "-c",
               "import torch, gpu_service.model.deepseek; print(torch.__version__, torch.version.cuda)", check=False)
    check(r.returncode == 0 and "+cpu" in r.stdout,
          f"{gpu_img}: CPU torch and the model ({r.stdout.strip() or r.stderr[-200:]})")

    umask = os.umask(0o022)
    os.umask(umask)
    r = podman("run", "--rm", *PODMAN_RUN, *mount, "--entrypoint", "python", experts_img, "-c",
               "import os, sys; d = sys.argv[1]; fs = sorted(os.listdir(d)); "
               "[open(os.path.join(d, f), 'rb').read(1) for f in fs]; print(len(fs))", cmodel, check=False)
    check(r.returncode == 0, f"{experts_img} (uid 10001) reads every file of a make-tiny checkpoint written with "
          f"umask {umask:03o} ({(r.stdout + r.stderr).strip()[-300:]})")

    print("local (no container) reference run ...", flush=True)
    want, host_isa = local_run(moesplit, model, n_experts)
    print(f"      local completion: {want!r}; kernel {host_isa}", flush=True)

    names_ = [f"{PREFIX}-shard0", f"{PREFIX}-shard1", f"{PREFIX}-gpu"]
    for n in names_:
        podman("rm", "-f", "-t", "0", n, check=False)
    try:
        ports, mports = [free_port(), free_port()], [free_port(), free_port()]
        started = []
        for i in range(2):
            t0 = time.monotonic()
            podman("run", "-d", "--name", names_[i], *PODMAN_RUN, *mount, experts_img,
                   *shard_args(cmodel, n_experts, i, ports[i], mports[i]))
            started.append(t0)
        for i, p in enumerate(ports):
            wait_for(lambda: serving(p), 120, f"shard container {i} SERVING", step=0.05)
            print(f"      shard{i} container: podman run to SERVING {time.monotonic() - started[i]:.2f} s", flush=True)
        isa = backend_info(mports[0])
        check(isa == host_isa, f"container kernel {isa} == host kernel {host_isa}")
        http = free_port()
        t0 = time.monotonic()
        podman("run", "-d", "--name", names_[2], *PODMAN_RUN, *mount, gpu_img,
               *gpu_args(cmodel, http, free_port(), ports))
        health = f"http://127.0.0.1:{http}/health"
        live = f"http://127.0.0.1:{http}/live"
        wait_for(lambda: http_status(health) == 200, 240, "GPU-service container /health 200", step=0.2)
        print(f"      GPU-service container: podman run to /health 200 {time.monotonic() - t0:.2f} s", flush=True)
        got = complete(http, "tiny")
        check(got == want, f"containers' greedy completion {got!r} == local {want!r}")

        t0 = time.monotonic()
        podman("stop", "-t", "10", names_[0])
        stop_s = time.monotonic() - t0
        code = podman("inspect", "--format", "{{.State.ExitCode}}", names_[0]).stdout.strip()
        check(stop_s < 10 and code == "0", f"podman stop shard0: {stop_s:.2f} s, exit status {code}")
        wait_for(lambda: http_status(health) == 503, 60, "/health 503 with shard0 stopped", step=0.2)
        check(True, "/health 503 with shard0 stopped")
        check(http_status(live) == 200, "/live 200 with shard0 stopped")
        podman("start", names_[0])
        wait_for(lambda: http_status(health) == 200, 120, "/health 200 after podman start", step=0.2)
        check(True, "/health 200 again after podman start")
        got2 = complete(http, "tiny")
        check(got2 == want, f"completion after the restart {got2!r} == local")
    except Exception as e:  # show the containers' logs with the failure
        failures.append(repr(e))
        print(f"FAIL  {e!r}", flush=True)
        for n in names_:
            print(f"----- podman logs {n}", flush=True)
            print(podman("logs", "--tail", "30", n, check=False).stderr[-4000:], flush=True)
    finally:
        for n in names_:
            podman("rm", "-f", "-t", "2", n, check=False)
        shutil.rmtree(work, ignore_errors=True)
    print(f"image-test: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
