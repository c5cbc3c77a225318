"""One persistent gRPC Forward stream per replica: requests fed by a queue, answers matched by seq."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import grpc

from gpu_service.experts.errors import ShardError
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
from wire.channel import INSTANCE_KEY


# ---- one persistent stream per replica ---------------------------------------------------------
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN,
})  # the replica (or the way to it) failed, not the request: another replica may answer


def _retryable(e: BaseException) -> bool:
    return isinstance(e, ShardError) and e.code in RETRYABLE


def instance_of(call) -> str:
    """The shard process id in a call's initial metadata ("" when absent: the call failed before the
    shard answered, or a shard that predates instance ids)."""
    try:
        md = call.initial_metadata()
    except Exception:  # noqa: BLE001 - a call torn down under us: no identity to check
        return ""
    return next((v for k, v in (md or ()) if k == INSTANCE_KEY), "")


class _ShardStream:
    """A bidi Forward stream fed by a queue; a reader thread resolves futures by seq.

    A shard refuses a bad request by ending the stream with the refusal (INVALID_ARGUMENT...): it
    answers in order, so the refusal is the oldest pending request's, and the requests queued behind
    it, which the shard never read, are re-sent on a new stream (they must not fail with another
    request's error). If the stream breaks (UNAVAILABLE...), every pending future fails with a
    ShardError naming the shard, and the next request opens a new stream. `expire()` enforces
    each request's deadline: a request past it fails every pending one with DEADLINE_EXCEEDED
    and cancels the stream (a shard that stopped answering)."""

    _CLOSE = object()

    def __init__(self, address: str, stub: experts_pb2_grpc.ExpertServiceStub, verify=None):
        self.address = address
        self.stub = stub
        # verify(instance id in the answer's initial metadata): returns when the process may be used, else
        # raises ShardError (gpu_service.experts.rejoin); called on each (re)opened stream before any answer
        self.verify = verify
        self.lock = threading.Lock()
        # seq -> (future, monotonic deadline, request), in the order the requests were queued
        self.pending: dict[int, tuple[Future, float, experts_pb2.LayerRequest]] = {}
        self.queue: queue.Queue | None = None
        self.call = None

    def _open(self) -> None:
        q: queue.Queue = queue.Queue()

        def requests():
            while True:
                item = q.get()
                if item is self._CLOSE:
                    return
                yield item

        call = self.stub.Forward(requests())
        self.queue, self.call = q, call
        threading.Thread(target=self._read, args=(call, q), name=f"experts-rx-{self.address}", daemon=True).start()

    def _read(self, call, q) -> None:
        err: ShardError | None = None
        try:
            if self.verify is not None:  # a re-opened stream may reach a restarted process: check it first
                self.verify(instance_of(call))
            for resp in call:
                with self.lock:
                    fut = self.pending.pop(resp.seq, (None,))[0]
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.RpcError as e:
            err = ShardError(self.address, e.code(), e.details() or str(e))
        except ShardError as e:  # the process changed and was refused (or could not be re-checked)
            err = e
            call.cancel()
        except Exception as e:  # noqa: BLE001 - surface anything on the waiting futures
            err = ShardError(self.address, None, repr(e))
        with self.lock:
            if self.call is not call:  # already failed by expire() / close()
                return
            self.call, self.queue = None, None  # this stream is finished; the next send opens a new one
            q.put(self._CLOSE)
            failed = list(self.pending.values())
            self.pending.clear()
        if err is None:
            err = ShardError(self.address, grpc.StatusCode.UNAVAILABLE, "stream closed by the shard")
        elif failed and not _retryable(err):  # a refusal: the oldest request's; the rest go again
            (fut, _, _), failed = failed[0], failed[1:]
            if not fut.done():
                fut.set_exception(err)
            for fut, deadline, req in failed:
                self._queue(req, fut, deadline)
            return
        for fut, _, _ in failed:
            if not fut.done():
                fut.set_exception(err)

    def _queue(self, req: experts_pb2.LayerRequest, fut: Future, deadline: float) -> None:
        """Queue req on the open stream (opening one if none is) with its future and deadline."""
        with self.lock:
            if self.call is None:
                self._open()
            self.pending[req.seq] = (fut, deadline, req)
            self.queue.put(req)

    def send(self, req: experts_pb2.LayerRequest, timeout_s: float) -> Future:
        """Queue one request; its Future resolves to the LayerResponse or a ShardError."""
        fut: Future = Future()
        self._queue(req, fut, time.monotonic() + timeout_s)
        return fut

    def expire(self, now: float) -> bool:
        """Fail everything pending if a request is past its deadline; True if it did."""
        with self.lock:
            if not any(d <= now for _, d, _ in self.pending.values()):
                return False
        self._fail_all(ShardError(self.address, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the deadline"))
        return True

    def _fail_all(self, err: ShardError) -> None:
        with self.lock:
            q, call = self.queue, self.call
            self.queue = self.call = None
            failed = list(self.pending.values())
            self.pending.clear()
        if q is not None:
            q.put(self._CLOSE)
        if call is not None:
            call.cancel()
        for fut, _, _ in failed:
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        self._fail_all(ShardError(self.address, grpc.StatusCode.CANCELLED, "experts client closed"))
