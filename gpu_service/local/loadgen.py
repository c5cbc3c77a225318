"""Concurrent streaming completions against `moesplit serve` (`moesplit bench`, bench/bench_decode.py):
start the server as its own process, wait for /health, run N streams at once and measure them.

    with ServeProcess(model_dir, ["--shards", "2"]) as srv:
        recs = run_streams(srv.port, 32, max_tokens=16)
        decode_tokens_per_s(recs), ttft_s(recs)
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from gpu_service.local.stack import ROOT

MODEL_NAME = "bench"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m moesplit serve --model DIR` on a free port with `extra` arguments; `start()`
    returns once /health answers 200 (or raises with the log's tail); `stop()` SIGTERMs it."""

    def __init__(self, model_dir: str, extra: list[str] | tuple[str, ...] = (), timeout_s: float = 300.0) -> None:
        self.model_dir, self.extra, self.timeout_s = model_dir, list(extra), timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="moesplit-bench-serve-", suffix=".log", delete=False)

    def start(self) -> "ServeProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "moesplit", "serve", "--model", self.model_dir, "--served-model-name", MODEL_NAME,
               "--port", str(self.port), "--grpc-port", "0", "--log-level", "WARNING", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + self.timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                what = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "is not healthy"
                raise RuntimeError(f"moesplit serve {what} after {self.timeout_s:.0f}s; its log "
                                   f"({self.log.name}):\n{self.tail()}")
            time.sleep(0.3)
        return self

    def _healthy(self) -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        except OSError:
            return False

    def tail(self, n: int = 3000) -> str:
        """The last `n` characters of the server's log."""
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        """SIGTERM the server (it stops its shards), SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class StreamRecord:
    """One streaming completion: when it was sent, when each chunk with text arrived (perf_counter
    s) and the tokens the server counted (usage.completion_tokens)."""

    sent: float
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0


def prompt(seed: int) -> str:
    """Stream `seed`'s prompt."""
    return f"Hello number {seed}, the quick brown fox"


def stream_once(port: int, max_tokens: int, seed: int, out: list) -> None:
    """One streaming /v1/completions (temperature 0, ignore_eos) appended to `out` as a StreamRecord."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt(seed),
                       "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    rec = StreamRecord(time.perf_counter())
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/v1/completions answered {resp.status}: {resp.read()[:500]!r}")
    for line in resp:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            t = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                rec.stamps.append(t)
            if chunk.get("usage"):
                rec.tokens = int(chunk["usage"]["completion_tokens"])
    c.close()
    if not rec.tokens:
        raise RuntimeError("the stream ended without a usage chunk (stream_options.include_usage)")
    out.append(rec)


def run_streams(port: int, n: int, max_tokens: int) -> list[StreamRecord]:
    """`n` concurrent streams of `max_tokens` tokens; raises when one returned fewer than 2 chunks."""
    recs: list[StreamRecord] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream_once(port, max_tokens, i, recs)
        except BaseException as e:  # reported below, in the caller's thread
            errors.append(e)

    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    if len(recs) != n or any(len(r.stamps) < 2 for r in recs):
        raise RuntimeError("a stream returned fewer than 2 chunks")
    return recs


def decode_tokens_per_s(recs: list[StreamRecord]) -> float:
    """Aggregate decode rate: tokens after each stream's first, over first chunk -> last chunk of all."""
    first = min(r.stamps[0] for r in recs)
    last = max(r.stamps[-1] for r in recs)
    return sum(r.tokens - 1 for r in recs) / (last - first)


def ttft_s(recs: list[StreamRecord]) -> float:
    """Median time to first token (request sent -> first chunk)."""
    ts = sorted(r.stamps[0] - r.sent for r in recs)
    return ts[len(ts) // 2]
