"""Replica health for readiness: every replica's grpc.health.v1 asked in parallel, kept fresh by a
background thread, so `/health` answers from memory in milliseconds.

Asking replicas one after another with a 1 s deadline each made `/health` as slow as the sum of
the stopped ones (one SIGSTOPped replica: 1.007 s, past the kubelet's default 1 s probe timeout).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import grpc

try:  # optional: the engine and model import without it (a bare CUDA host); readiness then says so
    from grpc_health.v1 import health_pb2, health_pb2_grpc
except ImportError:
    health_pb2 = health_pb2_grpc = None

MISSING = "UNKNOWN: grpcio-health-checking is not installed (pip install grpcio-health-checking)"


def check_parallel(channels: dict[str, "grpc.Channel | None"], timeout_s: float) -> dict[str, str]:
    """{address: "SERVING" | "NOT_SERVING" | "<CODE>: details"}: all asked at once, so the whole
    check takes at most `timeout_s` however many replicas are stopped."""
    if health_pb2 is None:
        return {addr: MISSING for addr, ch in channels.items() if ch is not None}
    req = health_pb2.HealthCheckRequest(service="")
    futs, out = {}, {}
    for addr, ch in channels.items():
        if ch is None:
            continue
        try:
            futs[addr] = health_pb2_grpc.HealthStub(ch).Check.future(req, timeout=timeout_s)
        except ValueError as e:  # channel closed meanwhile (a reconnect swapped it)
            out[addr] = f"UNAVAILABLE: {e}"
    for addr, f in futs.items():
        try:
            out[addr] = health_pb2.HealthCheckResponse.ServingStatus.Name(f.result().status)
        except grpc.RpcError as e:
            out[addr] = f"{e.code().name}: {e.details()}"
        except ValueError as e:
            out[addr] = f"UNAVAILABLE: {e}"
    return out


class HealthCache:
    """The latest `check()` result, refreshed every `interval_s` by a daemon thread started on the
    first `get()` (which waits for the first result); later calls return at once."""

    def __init__(self, check: Callable[[], dict[str, str]], interval_s: float = 1.0):
        self.check, self.interval_s = check, interval_s
        self.value: dict[str, str] | None = None
        self.at = 0.0  # monotonic time of `value`
        self._lock = threading.Lock()
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def get(self, wait_s: float = 5.0) -> dict[str, str]:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="experts-health", daemon=True)
                self._thread.start()
        self._first.wait(wait_s)
        return dict(self.value or {})

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                v = self.check()
            except Exception as e:  # noqa: BLE001 - keep refreshing; say what failed
                v = {"*": f"UNKNOWN: health check failed: {type(e).__name__}: {e}"}
            self.value, self.at = v, time.monotonic()
            self._first.set()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def close(self) -> None:
        self._stop.set()
