"""A decode step's claim on the shared-memory fast paths, for the native step (issue 20).

The native step (gpu_service.model.native_decode.remote_step, C in native_remote.c) runs every
layer of an all-decode step without returning to Python, so it writes the layer calls into the
shared slots and rings the doorbells itself. For that it needs, for every shard group, one healthy
replica whose shared-memory fast path is idle (no call pending) with a free slot per micro-batch.
`claim()` takes them (the replica picked round-robin, as per call on the Python path, here per
step; another live replica of the group when that one's path is busy or broken), `Handoff.finish()` gives them back after the run and reports every call to the client's
observer, as the Python path would have.

A run that stopped early (a refusal, a broken doorbell, a deadline, a signal) is settled the way
the Python path settles the same event, and the caller then runs the whole step again through the
Python path, which owns failover and the gRPC fallback:

    broken doorbell  FastPath._break: the path is not used again (its pending calls go to gRPC), and
                     the replica is marked down unless a health check finds it serving
    deadline         FastPath.expire and the replica marked down, so the re-run fails over at once
    refused          nothing: the re-run gets the same refusal and raises it as the Python path does
    signal           nothing

Calls still out when the run stopped become pending entries of their fast path, so their slots
stay taken until the late answer arrives (or the deadline passes). numpy only, no torch.
"""
from __future__ import annotations

import itertools
import time
from concurrent.futures import Future

import grpc
import numpy as np

from gpu_service.experts.errors import ShardError
from gpu_service.experts.shm import FastPath
from wire import shm as P

BROKEN, TIMEOUT, REFUSED, INTR = 1, 2, 3, 4  # native_remote.h's NR_* failure codes
SEQ_BASE = 1 << 62  # native doorbell seqs: far above the Python path's own (itertools.count(1))
_steps = itertools.count()
_WIRE_BYTES = (4, 2, 2)


def _settled() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class Handoff:
    """The claimed fast paths of one step: `paths` is what RemoteRun takes."""

    def __init__(self, client, claims: list[tuple], n_mb: int, whole: bool = True):
        self.client, self.claims, self.n_mb, self.whole = client, claims, n_mb, whole
        self.timeout_s, self.spin_s = client.timeout_s, claims[0][2].spin_s
        self.seq0 = SEQ_BASE + (next(_steps) << 24)
        self.paths = []
        for _, _, fp, slots, held in claims:
            lay = fp.lay
            bases = [lay.slot_base(s) for s in slots] + [0] * (2 - len(slots))
            self.paths.append((fp.base_ptr, bases[0], bases[1], lay.hidden_off, lay.ids_off, lay.w_off, lay.out_off,
                               fp.sock.fileno(), slots[0], slots[1] if len(slots) > 1 else -1, fp.hc,
                               0 if held is None else held.ctypes.data))

    def finish(self, rc: int, fail_path: int, msg: str, calls: list[tuple], path_calls: list[int]) -> None:
        """After the run: report the calls, give the slots back (or leave the ones still out pending)
        and settle a failure (see the module docstring). Always called, also when the run raised."""
        client, H, k = self.client, self.client.cfg.hidden_size, self.client.cfg.num_experts_per_tok
        if rc == 0 and calls:
            if self.whole:
                client.native_steps += 1
            else:
                client.native_call_steps += 1
        observer = client.observer
        out: dict[int, list] = {}
        seen: list[tuple] = []
        for (layer, p, mb, rows, status, slot, seq, sent_ns, rtt_ns, _c, _s) in calls:
            fp = self.claims[p][2]
            if status == -1:
                out.setdefault(p, []).append((seq, slot, sent_ns * 1e-9 + self.timeout_s, rows))
            elif observer is not None:
                ok = status == P.OK
                seen.append((layer, fp.address, rtt_ns * 1e-9, rows * (H * _WIRE_BYTES[fp.hc] + k * 12),
                             rows * H * 4 if ok else 0, ok))
        if seen:
            try:
                many = getattr(observer, "observe_many", None)
                if many is not None:
                    many(seen)
                else:
                    for c in seen:
                        observer(*c)
            except Exception:  # noqa: BLE001 - metrics never break a forward
                pass
        for p, (r, _, fp, slots, _) in enumerate(self.claims):
            fp.calls += path_calls[p] if p < len(path_calls) else 0
            late = out.get(p, [])
            taken = {slot for _, slot, _, _ in late}
            with fp.lock:
                for seq, slot, deadline, rows in late:  # a late answer frees its slot (FastPath._receive)
                    fp.pending[seq] = (slot, Future(), deadline, rows, _settled)
                fp.free.extend(s for s in slots if s not in taken)
                fp.claimed = False
            if rc == BROKEN and p == fail_path:
                fp._break(msg)
                self._suspect(r, msg)
            elif rc == TIMEOUT and p == fail_path:
                fp.expire(time.monotonic() + 1e-3)  # the call that timed out is pending past its deadline
                client._mark_down(r, ShardError(r.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                f"no answer within {client.timeout_s}s (shm)"))

    def _suspect(self, r, why: str) -> None:
        """A broken doorbell: is the replica still there? The Python path learns it when its gRPC
        re-send fails; here one health check (at most 1 s) decides, so a dead replica is marked down
        (and reconnected when it comes back) instead of staying picked and skipped."""
        from gpu_service.experts.health import check_parallel

        status = check_parallel({r.address: r.channel}, min(1.0, self.client.timeout_s)).get(r.address, "UNKNOWN")
        if status != "SERVING":
            self.client._mark_down(r, ShardError(r.address, grpc.StatusCode.UNAVAILABLE,
                                                 f"shm fast path broke ({why}); health check: {status}"))

    def release(self) -> None:
        """Give the paths back unused."""
        self.finish(0, -1, "", [], [])


def claim(client, rows: list[int], k: int, has_f16: bool, whole: bool = True) -> Handoff | None:
    """One idle shared-memory fast path per shard group for a step of micro-batches of `rows`
    rows each (`whole`: for the whole step in C, else for its calls one by one), or None (the step
    takes the Python path)."""
    fast = getattr(client, "fast", None)
    if fast is None or fast.mode == "grpc" or not client.groups or not 1 <= len(rows) <= 2:
        return None
    claims: list[tuple] = []
    E = client.cfg.n_routed_experts
    from gpu_service.experts.client import _mask

    def give_back():
        for _, _, fp, slots, _ in claims:
            with fp.lock:
                fp.free.extend(slots)
                fp.claimed = False
        return None

    def take(r):
        """r's fast path claimed (its slots), else None; a live replica whose path broke or that
        reconnected since is offered a fresh one (in the background, as FastPaths.send does)."""
        fp, stream = fast.paths.get(r.address, (None, None))
        if not isinstance(fp, FastPath):
            return None, None
        if stream is not r.stream or not fp.usable:
            if r.healthy:
                fast._renegotiate(r, client.cfg)
            return None, None
        if max(rows) > fp.lay.max_tokens or k > fp.lay.max_k or (fp.hc == 2 and not has_f16):
            return None, None
        with fp.lock:
            if not fp.usable or fp.claimed or fp.pending or len(fp.free) < len(rows):
                return None, None
            fp.claimed = True
            return fp, [fp.free.pop() for _ in rows]

    for g in client.groups:
        first = client._pick(g, [])  # the round-robin turn; the group's other live replicas after it
        if first is None:
            return give_back()
        with client._lock:
            live = [x for x in g.replicas if x.healthy and x is not first]
        for r in [first] + live:
            fp, slots = take(r)
            if fp is not None:
                break
        else:
            return give_back()
        held = None if g.desc.all_experts else _mask(g.desc, E).view(np.uint8)
        claims.append((r, g, fp, slots, held))
    return Handoff(client, claims, len(rows), whole)
