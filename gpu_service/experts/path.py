"""What every fast path to a replica shares (shared memory, TCP): pending calls, deadlines, failover to gRPC.

There is no reader thread: the thread waiting for a result receives the answers itself
(`DrivenFuture`), which saves two thread wake-ups per call.
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import grpc
import numpy as np

from gpu_service.experts.call import Moved
from gpu_service.experts.errors import ShardError
from wire import shm as P

log = logging.getLogger("moesplit.shm")


DEFAULT_SLOTS = 4  # calls in flight per replica (micro-batch ping-pong needs 2)
DEFAULT_MAX_TOKENS = 512  # rows per fast-path call; larger calls (long prefill chunks) go over gRPC
WATCH_S = 0.05  # how often the reader checks deadlines while waiting


class FastResponse:
    """A layer call's answer over shared memory: output [T, H] float32 (a private copy)."""

    __slots__ = ("output", "compute_us", "server_us")

    def __init__(self, output: np.ndarray, compute_us: int, server_us: int):
        self.output, self.compute_us, self.server_us = output, compute_us, server_us

    def ByteSize(self) -> int:  # what the metrics observer counts as bytes received
        return int(self.output.nbytes)


class _Path:
    """What every fast path to one replica shares: its socket, pending calls with their deadlines,
    and failing over to gRPC when it breaks. There is no reader thread: answers are received by the
    thread that waits for a result (`pump`, called from `DrivenFuture.result`), which saves two
    thread wake-ups per call. Pending entries: seq -> (slot, future, deadline, T, fallback)."""

    kind = "?"
    direct = False  # takes calls from raw addresses (send_at / finish / inputs): handoff's direct calls
    instance = ""  # ShardInfo.instance_id of the shard process that accepted it (its Attach answer)

    def __init__(self, address: str, sock: socket.socket):
        self.address, self.sock = address, sock
        self.lock = threading.Lock()  # slots and pending
        self.rx = threading.Lock()  # held by the one thread receiving answers
        self.pending: dict[int, tuple] = {}
        self.seq = itertools.count(1)
        self.usable = True
        self.calls = 0
        self.spin_s = P.spin_seconds()

    def describe(self) -> str:
        return self.kind

    def pump(self) -> None:
        """Receive one answer (or wait up to WATCH_S) and resolve its future. If another thread is
        receiving, just yield to it briefly."""
        if not self.rx.acquire(blocking=False):
            time.sleep(0.0002)
            return
        try:
            done = self._receive() if self.usable else None
        finally:
            self.rx.release()
        if done is not None:  # callbacks run outside the receive lock
            fut, res, err = done
            if err is None:
                fut.set_result(res)
            else:
                fut.set_exception(err)

    def _receive(self) -> tuple | None:
        """One answer as (future, response, None) or (future, None, error); None if none came."""
        raise NotImplementedError

    def _send_failed(self, seq: int, why: str) -> None:
        with self.lock:
            self.pending.pop(seq, None)
        self._break(why)

    def expire(self, now: float) -> None:
        """A call past its deadline: the shard stopped answering. Fail them all; stop the fast path."""
        with self.lock:
            if not any(d <= now for _, _, d, _, _ in self.pending.values()):
                return
            self.usable = False
            failed = list(self.pending.values())
            self.pending.clear()
        self._close()
        log.warning("%s fast path to %s: no answer within the deadline; using gRPC", self.kind, self.address)
        err = ShardError(self.address, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within the deadline ({self.kind})")
        for _, fut, _, _, _ in failed:
            if not fut.done():
                fut.set_exception(err)

    def _break(self, why: str) -> None:
        """Transport failure: re-send every pending call over gRPC; never use this fast path again."""
        with self.lock:
            was = self.usable
            self.usable = False
            moved = list(self.pending.values())
            self.pending.clear()
        if was:
            log.warning("%s fast path to %s stopped (%s); using gRPC", self.kind, self.address, why)
        self._close()
        for _, fut, _, _, fallback in moved:
            if fallback is None:  # a direct part (call.Hold): its LayerCall re-sends it
                fut.set_exception(Moved(why))
            else:
                _chain(fut, fallback, self.address)

    def _close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:
            self.usable = False
            failed = list(self.pending.values())
            self.pending.clear()
        self._close()
        for _, fut, _, _, _ in failed:
            if not fut.done():
                fut.set_exception(ShardError(self.address, grpc.StatusCode.CANCELLED, "experts client closed"))


def shard_error(address: str, status: int, text: str):
    """A fast path's refusal (status: gRPC code INVALID_ARGUMENT or INTERNAL) as a ShardError."""
    code = grpc.StatusCode.INVALID_ARGUMENT if status == P.INVALID_ARGUMENT else grpc.StatusCode.INTERNAL
    return ShardError(address, code, text)


class DrivenFuture(Future):
    """A Future whose waiters receive the fast paths' answers themselves (no reader thread)."""

    def __init__(self, paths: "FastPaths"):
        super().__init__()
        self._paths = paths

    def _drive(self, timeout: float | None) -> float | None:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            busy = [fp for fp, _ in list(self._paths.paths.values()) if fp is not None and fp.pending and fp.usable]
            if not busy:
                # nothing on a fast path now: the answer comes from gRPC, unless a failover (run from a gRPC
                # callback thread) puts the call on another replica's fast path meanwhile, which we must pump
                wait_s = WATCH_S if end is None else min(WATCH_S, max(0.0, end - time.monotonic()))
                futures_wait([self], timeout=wait_s)
                if end is not None and time.monotonic() >= end:
                    break
                continue
            if len(busy) > 1:  # receive from whichever shard answers first
                try:
                    ready = _select_spin([fp.sock for fp in busy], busy[0].spin_s)
                except (OSError, ValueError):  # a socket closed meanwhile
                    ready = [fp.sock for fp in busy]
                if not ready:
                    now = time.monotonic()
                    for fp in busy:
                        fp.expire(now)
                busy = [fp for fp in busy if fp.sock in ready]
            for fp in busy:
                fp.pump()
                if self.done():
                    break
            if end is not None and time.monotonic() >= end:
                break
        return None if end is None else max(0.0, end - time.monotonic())

    def result(self, timeout: float | None = None):
        return super().result(self._drive(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._drive(timeout))


def _select_spin(socks: list, spin_s: float) -> list:
    """The doorbells with an answer waiting: polled for up to spin_s (yielding the CPU between
    polls, see cpu_expert_service.shm_transport), then waited for up to WATCH_S."""
    end = time.perf_counter() + spin_s
    while True:
        ready = select.select(socks, [], [], 0)[0]
        if ready or time.perf_counter() >= end:
            break
        os.sched_yield()
    return ready or select.select(socks, [], [], WATCH_S)[0]


def _chain(fut: Future, fallback, address: str) -> None:
    try:
        g = fallback()
    except Exception as e:  # noqa: BLE001
        fut.set_exception(ShardError(address, grpc.StatusCode.UNAVAILABLE, f"gRPC fallback failed: {e!r}"))
        return

    def done(g: Future) -> None:
        e = g.exception()
        if e is None:
            fut.set_result(g.result())
        else:
            fut.set_exception(e)

    g.add_done_callback(done)
