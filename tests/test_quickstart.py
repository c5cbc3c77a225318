"""The README's Quickstart, run as a new user would: its commands, parsed from README.md, in a clean
shell (`env -i`, PATH=/usr/bin:/bin, a fresh HOME) that has nothing but what the Quickstart says.

What the test changes, and why: the tiny model's directory (`/tmp/tiny`) goes under pytest's tmp_path
and the serve ports become free ones (`--port 8000` -> `--port FREE --grpc-port 0`), so parallel runs
cannot collide; PYTHONPATH names this
checkout, so the code under test is this checkout's even when the venv's editable install points at
another one (on a fresh clone after `make setup` they are the same). `make setup` itself is not run
(the test runs inside a set-up checkout); `helm` lines need a Kubernetes cluster and are skipped with
that reason. Lines after a `$ command` line are its expected output: each must appear in what it printed.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def quickstart_blocks(path: str = README) -> list[tuple[str, str]]:
    """(language, text) of every fenced block in the README's `## Quickstart` section, in order."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Quickstart' section"
    return [(lang, body) for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", m.group(1), re.S | re.M)]


def shell_steps(blocks) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of the Quickstart's shell blocks. In a block that uses `$ `
    prompts the other lines are output; a trailing backslash continues a command."""
    steps: list[tuple[str, list[str]]] = []
    for lang, body in blocks:
        if lang not in ("", "sh", "bash", "console"):
            continue
        prompted = any(line.startswith("$ ") for line in body.splitlines())
        pending = ""
        for line in body.splitlines():
            if prompted and not line.startswith("$ ") and not pending:
                if steps and line.strip():
                    steps[-1][1].append(line.strip())
                continue
            line = line[2:] if line.startswith("$ ") else line
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            if pending.strip():
                steps.append((pending.strip(), []))
            pending = ""
    return steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv() -> str:
    """The venv the Quickstart activates: the checkout's `.venv` when there is one, else the venv of
    the interpreter running the tests (a worktree sharing another checkout's venv)."""
    own = os.path.join(ROOT, ".venv")
    return own if os.path.exists(os.path.join(own, "bin", "activate")) else sys.prefix


class CleanShell:
    """Runs Quickstart lines with `bash -c` under `env -i` in a working directory whose `.venv` is the
    venv to activate; every command is preceded by the Quickstart's own activation line."""

    def __init__(self, tmp_path, activate: str, subst: dict[str, str]):
        self.cwd = tmp_path / "checkout"
        self.cwd.mkdir()
        (self.cwd / ".venv").symlink_to(_venv())
        home = tmp_path / "home"
        home.mkdir()
        self.env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={home}", f"PYTHONPATH={ROOT}", "LANG=C.UTF-8"]
        self.activate, self.subst = activate, subst

    def line(self, cmd: str) -> str:
        for a, b in self.subst.items():
            cmd = cmd.replace(a, b)
        return f"set -e; {self.activate}; {cmd}"

    def run(self, cmd: str, timeout: float = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.env + ["bash", "-c", self.line(cmd)], cwd=self.cwd, input=stdin,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, cmd: str) -> subprocess.Popen:
        return subprocess.Popen(self.env + ["bash", "-c", self.line("exec " + cmd)], cwd=self.cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"moesplit serve exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM to the serve process group (serve stops its own shards), then its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.stdout.read()


def test_quickstart_parses():
    """The Quickstart starts with set-up and activation, and every moesplit command it runs exists."""
    steps = shell_steps(quickstart_blocks())
    cmds = [c for c, _ in steps]
    assert cmds[:2] == ["make setup", ". .venv/bin/activate"], cmds[:2]
    from moesplit.cli import COMMANDS

    for c in cmds:
        if c.startswith("moesplit "):
            assert shlex.split(c)[1] in COMMANDS, c
    assert any(lang == "python" for lang, _ in quickstart_blocks()), "the Serve example's client code"


@pytest.mark.slow
def test_quickstart_runs_in_a_clean_shell(tmp_path):
    """Every Quickstart command, as written (bar the substitutions in the module docstring), succeeds in
    a clean shell; the serve step answers the Quickstart's Python client; `$` lines print their output."""
    blocks = quickstart_blocks()
    steps = shell_steps(blocks)
    port = _free_port()
    activate = steps[1][0]
    sh = CleanShell(tmp_path, activate, {"/tmp/tiny": str(tmp_path / "tiny"),
                                         "--port 8000": f"--port {port} --grpc-port 0"})
    client = next(body for lang, body in blocks if lang == "python")
    assert ":8000/" in client, "the client example talks to the serve command's port"
    client = client.replace(":8000/", f":{port}/")
    ran, skipped = [], []
    for cmd, expected in steps[2:]:
        if cmd.startswith("helm "):
            skipped.append(f"{cmd!r}: needs a Kubernetes cluster (the chart is checked by tests/test_chart.py)")
            continue
        if cmd.startswith("moesplit serve "):
            proc = sh.start(cmd)
            try:
                _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, timeout=180)
                r = sh.run("python -", stdin=client, timeout=120)
            finally:
                log = _stop(proc)
            assert r.returncode == 0, f"the Quickstart's client failed:\n{r.stderr[-3000:]}\nserve:\n{log[-3000:]}"
            assert r.stdout.strip(), "the chat completion came back empty"
            ran.append(cmd)
            continue
        r = sh.run(cmd)
        assert r.returncode == 0, f"{cmd!r} exited {r.returncode} in a clean shell:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        out = " ".join((r.stdout + "\n" + r.stderr).split())
        for line in expected:
            assert " ".join(line.split()) in out, f"{cmd!r}: the README says it prints {line!r}; it printed:\n{r.stdout[-2000:]}"
        ran.append(cmd)
    print("ran:", *ran, sep="\n  ")
    print("skipped:", *skipped, sep="\n  ")
    assert any(c.startswith("moesplit generate") for c in ran)
    assert (tmp_path / "checkout" / "plan-values.yaml").exists()


def test_moesplit_is_not_on_a_clean_path():
    """The reason for the activation line: a clean shell has no `moesplit` until the venv is active."""
    r = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", "command -v moesplit"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        pytest.skip(f"moesplit is installed system-wide at {r.stdout.strip()}")
    assert r.returncode != 0


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_umask_modes(tmp_path, umask):
    """make-tiny (built-in and a real-format tokenizer), convert and plan --helm-values write files
    0666 & ~umask and directories 0777 & ~umask, as open() and mkdir do; a container user (uid 10001)
    can then read a checkpoint written with the default umask."""
    tiny, kimi, packed, values = (tmp_path / n for n in ("tiny", "kimi", "packed", "values.yaml"))
    py = shlex.quote(sys.executable)
    script = "; ".join([
        f"umask {umask:03o}", "set -e",
        f"{py} -m moesplit make-tiny {tiny} --format bf16",
        f"{py} -m moesplit make-tiny {kimi} --format int4 --tokenizer kimi-k2",
        f"{py} -m moesplit convert --model {tiny} --out {packed} --shards 2",
        f"{py} -m moesplit plan --model kimi-k2-thinking --gpu 24GiB --helm-values {values}",
    ])
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    wrong = []
    for top in (tiny, kimi, packed, values):
        entries = [top] + ([p for p in top.rglob("*")] if top.is_dir() else [])
        for p in entries:
            want = (0o777 if p.is_dir() else 0o666) & ~umask
            got = p.stat().st_mode & 0o7777
            if got != want:
                wrong.append(f"{p.relative_to(tmp_path)}: {got:04o}, expected {want:04o}")
    assert not wrong, "\n".join(wrong)
    assert any(p.suffix == ".safetensors" for p in tiny.iterdir())
