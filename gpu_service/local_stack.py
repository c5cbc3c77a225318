"""Start CPU expert shard processes on loopback (demo, tests, `moesplit generate`).

    with start_shards(model_dir, n=2, split="experts") as shards:
        client = ExpertsClient(shards.addresses, cfg).connect()

Each shard is `python -m cpu_expert_service.server` on 127.0.0.1, port 0, with a port file;
`start_shards` returns once every shard is serving (or raises with the dead child's stderr).
Expert split: contiguous even ranges of expert ids; intermediate split: `--slice i/n`.
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

from checkpoint.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ShardStartError(RuntimeError):
    """A shard process died or did not become ready in time."""


def expert_ranges(n_experts: int, n: int) -> list[tuple[int, int]]:
    """Contiguous even split of range(n_experts) into n parts, as inclusive (first, last)."""
    if not 1 <= n <= n_experts:
        raise ValueError(f"cannot split {n_experts} experts into {n} shards; need 1 <= n <= {n_experts}")
    bounds = [(i * n_experts) // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


@dataclass
class LocalShards:
    addresses: list[str]
    procs: list[subprocess.Popen]
    workdir: str
    logs: list[str] = field(default_factory=list)  # stderr log file of each shard

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every shard, wait, SIGKILL stragglers, remove the work directory."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
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


def start_shards(
    model_dir: str,
    n: int,
    split: str = "experts",
    backend: str = "numpy",
    extra_args: tuple[str, ...] | list[str] = (),
    timeout_s: float = 120.0,
) -> LocalShards:
    """Launch n shard processes splitting the model's routed experts; wait until all serve."""
    cfg = load_config(model_dir)
    if split == "experts":
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
    procs, logs, port_files = [], [], []
    shards = LocalShards([], procs, workdir, logs)
    try:
        for i, sa in enumerate(shard_args):
            port_file = os.path.join(workdir, f"shard{i}.port")
            log = os.path.join(workdir, f"shard{i}.log")
            cmd = [sys.executable, "-m", "cpu_expert_service.server", "--model", os.fspath(model_dir), *sa,
                   "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
                   "--shard-id", f"shard{i}", "--backend", backend, *extra_args]
            with open(log, "wb") as err:
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT))
            logs.append(log)
            port_files.append(port_file)
        ports: list[int | None] = [None] * len(procs)
        deadline = time.monotonic() + timeout_s
        while any(p is None for p in ports):
            for i, p in enumerate(procs):
                if ports[i] is not None:
                    continue
                if p.poll() is not None:
                    raise ShardStartError(
                        f"expert shard {i} ({' '.join(shard_args[i])}) exited with code {p.returncode} "
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
        shards.addresses = [f"127.0.0.1:{p}" for p in ports]
        return shards
    except BaseException:
        shards.stop()
        raise
