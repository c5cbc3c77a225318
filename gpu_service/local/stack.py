"""Start CPU expert shard processes on loopback (demo, tests, `moesplit generate`).

    with start_shards(model_dir, n=2, split="experts") as shards:
        client = ExpertsClient(shards.addresses, cfg).connect()

Each shard is `python -m cpu_expert_service.server` on 127.0.0.1, port 0 (a port file); returns
once every shard serves, else raises with the dead child's stderr. `replicas=R`: R processes per
shard, addresses replica set by replica set (the Helm chart's order). `kill(i)` / `restart(i)`
are for tests; `auth_token` is set as MOESPLIT_SHARD_TOKEN in the shards' environment.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from checkpoint.config_v4 import load_any_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (this file: gpu_service/local/)


class ShardStartError(RuntimeError):
    """A shard process died or did not become ready in time."""


def expert_ranges(n_experts: int, n: int) -> list[tuple[int, int]]:
    """Contiguous even split of range(n_experts) into n parts, as inclusive (first, last)."""
    if not 1 <= n <= n_experts:
        raise ValueError(f"cannot split {n_experts} experts into {n} shards; need 1 <= n <= {n_experts}")
    bounds = [(i * n_experts) // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


def stop_processes(procs, timeout_s: float = 10.0) -> None:
    """SIGTERM every process still running, wait up to `timeout_s` for them all, SIGKILL stragglers."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class LocalShards:
    addresses: list[str]
    procs: list[subprocess.Popen]
    workdir: str
    logs: list[str] = field(default_factory=list)  # stderr log file of each shard
    cmds: list[list[str]] = field(default_factory=list)  # command line of each process
    env: dict = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)  # shard group of each process

    def kill(self, i: int) -> None:
        """SIGKILL process i (no goodbye to its clients) and reap it."""
        p = self.procs[i]
        if p.poll() is None:
            p.kill()
        p.wait()

    def restart(self, i: int, timeout_s: float = 120.0) -> None:
        """Start process i again on the same port; returns once it serves."""
        if self.procs[i].poll() is None:
            raise RuntimeError(f"shard process {i} is still running")
        port = self.addresses[i].rsplit(":", 1)[1]
        cmd = list(self.cmds[i])
        pf = cmd[cmd.index("--port-file") + 1]
        cmd[cmd.index("--port") + 1] = port
        if os.path.exists(pf):
            os.remove(pf)
        with open(self.logs[i], "ab") as err:
            self.procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=self.env, cwd=ROOT)
        _wait_ports([self.procs[i]], [pf], [self.logs[i]], [" ".join(cmd[-12:])], timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every shard, wait, SIGKILL stragglers, remove the work directory."""
        stop_processes(self.procs, timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalShards":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _wait_ports(procs, port_files, logs, what, timeout_s: float) -> list[int]:
    ports: list[int | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(p is None for p in ports):
        for i, p in enumerate(procs):
            if ports[i] is not None:
                continue
            if p.poll() is not None:
                raise ShardStartError(
                    f"expert shard {i} ({what[i]}) exited with code {p.returncode} "
                    f"before serving; its stderr:\n{_tail(logs[i])}"
                )
            if os.path.exists(port_files[i]):
                with open(port_files[i]) as f:
                    ports[i] = int(f.read().strip())
        if time.monotonic() > deadline:
            late = [i for i, p in enumerate(ports) if p is None]
            raise ShardStartError(
                f"expert shards {late} not ready after {timeout_s:.0f}s; stderr of shard {late[0]}:\n"
                f"{_tail(logs[late[0]])}"
            )
        time.sleep(0.05)
    return ports


def add_local_shard_arguments(p) -> None:
    """The local shard processes of `moesplit serve` / `generate`: how many, split, backend, replicas."""
    p.add_argument("--shards", type=int, default=2, help="number of local expert shard processes")
    p.add_argument("--split", choices=["experts", "intermediate"], default="experts",
                   help="shard by expert subsets or by intermediate slices of every expert")
    p.add_argument("--backend", default="auto",
                   help="shard compute backend: auto (the Cython kernels when built) | kernels | numpy")
    p.add_argument("--replicas", type=int, default=1,
                   help="processes per shard (replicas with the same experts: load spread and failover)")


def start_shards(
    model_dir: str,
    n: int,
    split: str = "experts",
    backend: str = "numpy",
    extra_args: tuple[str, ...] | list[str] = (),
    timeout_s: float = 120.0,
    replicas: int = 1,
    metrics_ports: list[int] | None = None,
    packed: str | None = None,
    auth_token: str | None = None,
) -> LocalShards:
    """Launch n shards (x `replicas`) splitting the routed experts and wait until all serve; with
    `packed` (a `moesplit convert` output), shard i serves `--packed DIR --shard-index i`."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if metrics_ports is not None and len(metrics_ports) != n * replicas:
        raise ValueError(f"metrics_ports: {len(metrics_ports)} ports for {n * replicas} shard processes")
    cfg = load_any_config(model_dir)  # shards serve DeepSeek-V4 experts too
    if packed is not None:
        from checkpoint.manifest import read_manifest

        have = len(read_manifest(packed)["shards"])
        if have != n:
            raise ValueError(f"{packed} holds {have} packed shards, not {n}; pass n={have} or convert again")
        shard_args = [["--packed", os.fspath(packed), "--shard-index", str(i)] for i in range(n)]
    elif split == "experts":
        shard_args = [["--experts", f"{a}-{b}"] for a, b in expert_ranges(cfg.n_routed_experts, n)]
    elif split == "intermediate":
        if not 1 <= n <= cfg.moe_intermediate_size:
            raise ValueError(f"cannot split moe_intermediate_size={cfg.moe_intermediate_size} into {n} slices")
        shard_args = [["--slice", f"{i}/{n}"] for i in range(n)]
    else:
        raise ValueError(f"split {split!r}: expected 'experts' or 'intermediate'")
    workdir = tempfile.mkdtemp(prefix="moesplit-shards-")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if auth_token:
        env.pop("MOESPLIT_SHARD_TOKEN_FILE", None)
        env["MOESPLIT_SHARD_TOKEN"] = auth_token
    procs, logs, port_files, what = [], [], [], []
    shards = LocalShards([], procs, workdir, logs, env=env)
    try:
        for r in range(replicas):
            for i, sa in enumerate(shard_args):
                name = f"shard{i}" + (f"r{r}" if replicas > 1 else "")
                port_file = os.path.join(workdir, f"{name}.port")
                log = os.path.join(workdir, f"{name}.log")
                cmd = [sys.executable, "-m", "cpu_expert_service.server", "--model", os.fspath(model_dir), *sa,
                       "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
                       "--shard-id", name, "--backend", backend, *extra_args]
                if metrics_ports is not None:  # Prometheus /metrics of process k on 127.0.0.1:metrics_ports[k]
                    cmd += ["--metrics-port", str(int(metrics_ports[len(procs)]))]
                with open(log, "wb") as err:
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT))
                logs.append(log)
                port_files.append(port_file)
                what.append(" ".join(sa))
                shards.cmds.append(cmd)
                shards.groups.append(i)
        ports = _wait_ports(procs, port_files, logs, what, timeout_s)
        shards.addresses = [f"127.0.0.1:{p}" for p in ports]
        return shards
    except BaseException:
        shards.stop()
        raise
