"""A shard restarted at its address while the client was not looking: re-describe it before use.

Every shard process has a random instance id (ShardInfo.instance_id), which it also puts in its
AttachShm / AttachTcp answers and in the initial metadata of its Forward / ForwardOne answers
(wire.channel.INSTANCE_KEY). The client remembers the id it checked for each replica (_Replica.instance,
from Describe). A connection that shows another id (a Forward stream re-opened after the old one
broke, a shared-memory or TCP data path renegotiated, a unary ForwardOne) reached a new process at the
same address: `Rejoin.check` describes it again and runs the checks of a returning replica (model
fingerprint and sizes, coverage, --act-bits, kernel: ExpertsClient.admit; the group's equivalence rule)
before any answer from that connection is used. A compatible process rejoins at once (its id
remembered: no GPU-service restart); an incompatible one is refused for good (marked down, `refused`
naming the flag or fingerprint), and the calls waiting on it fail over to the group's other replicas
(a sole replica's calls fail with that error). Comparing ids costs nothing per call: the id arrives
with answers the client reads anyway, and a Describe is only sent when it changed.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import grpc

from gpu_service.experts.errors import CoverageError, FingerprintError, ShardError
from gpu_service.experts.stream import instance_of
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

log = logging.getLogger("moesplit.experts_client")


class Rejoin:
    """The identity checks of one ExpertsClient's replicas (see the module docstring)."""

    def __init__(self, client):
        self.client = client
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def _replica_lock(self, address: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(address, threading.Lock())

    def check(self, r, instance: str) -> None:
        """Return when answers of process `instance` at replica r may be used; else ShardError
        (UNAVAILABLE: the caller fails over) naming why. Free when the id is the one checked."""
        if not instance or instance == r.instance:
            return
        with self._replica_lock(r.address):
            if r.refused is not None:
                raise ShardError(r.address, grpc.StatusCode.UNAVAILABLE, r.refused)
            if instance == r.instance:  # another connection re-checked it meanwhile
                return
            self._recheck(r, instance)

    def _recheck(self, r, instance: str) -> None:
        """Describe the new process at r and run a returning replica's checks (r's lock held)."""
        c = self.client
        if r.desc is None or r.channel is None or r.group is None:
            self._down(r, "restarted (a new process) before it was ever described; reconnecting")
        try:
            info = experts_pb2_grpc.ExpertServiceStub(r.channel).Describe(
                experts_pb2.DescribeRequest(), timeout=c.timeout_s)
        except grpc.RpcError as e:
            self._down(r, f"restarted (a new process) and its Describe failed: {e.code().name}: {e.details()}")
        if info.instance_id != instance:
            self._down(r, "restarted again while it was being re-checked; reconnecting")
        try:
            desc = c.admit(r, info)
            r.group.check_equivalent(r.address, info)
        except (FingerprintError, CoverageError) as e:
            r.refused = str(e)
            log.error("%s", e)
            c.fast.drop(r.address, f"refused: {e}")
            err = ShardError(r.address, grpc.StatusCode.UNAVAILABLE, str(e))
            c._mark_down(r, err)
            raise err from None
        r.desc = desc
        r.instance = instance
        log.info("expert shard %s restarted (new process, pid %d); re-checked what it serves: rejoining",
                 r.address, info.pid)

    def _down(self, r, why: str) -> None:
        """Mark r down (the supervisor's reconnect re-describes it) and raise ShardError(UNAVAILABLE, why)."""
        err = ShardError(r.address, grpc.StatusCode.UNAVAILABLE, why)
        self.client._mark_down(r, err)
        raise err

    def unary_done(self, r, call, out: Future) -> None:
        """A ForwardOne `call` to r finished: its answer into `out` once its process is the checked one
        (a changed one is re-checked on a thread of its own, not on gRPC's callback thread)."""
        try:
            resp = call.result()
        except grpc.RpcError as e:
            out.set_exception(ShardError(r.address, e.code(), e.details() or str(e)))
            return
        instance = instance_of(call)
        if not instance or instance == r.instance:
            out.set_result(resp)
            return

        def recheck():
            try:
                self.check(r, instance)
            except ShardError as e:
                out.set_exception(e)
                return
            out.set_result(resp)

        threading.Thread(target=recheck, name=f"experts-recheck-{r.address}", daemon=True).start()
