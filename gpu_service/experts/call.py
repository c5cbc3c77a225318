"""One layer call of the experts client in flight: its parts (one per shard group it routes to),
waited for and summed by `LayerCall.result`. numpy only.

A part goes straight onto the picked replica's fast path when it can (`Hold`: no Future, no lock
or condition to build, the waiting thread receives the answer itself through the C client); else,
and whenever such a part fails (a refusal, a deadline, a broken doorbell), through the client's
per-call failover (`ExpertsClient._call_group`: the same inputs, another replica or gRPC). The sum
is taken in group order whichever way each part was answered, so the bits are the same.
"""
from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout

import ml_dtypes
import numpy as np

from gpu_service.experts.errors import ExpertsClientError, ShardError

WIRE_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def array_of(t) -> np.ndarray:
    """A part's output as float32 [T_s, H]: a fast path's own copy as is, a gRPC Tensor decoded."""
    if isinstance(t, np.ndarray):  # fast path: already a private float32 copy
        return t
    dt = WIRE_NP.get(t.dtype)
    if dt is None:
        raise ExpertsClientError(f"shard answered with dtype {t.dtype!r}")
    # a read-only view of the message bytes when float32 (no copy: it is only added into the sum)
    return np.asarray(np.frombuffer(t.data, dtype=dt).reshape(tuple(t.shape)), dtype=np.float32)


class Moved(Exception):
    """A direct part whose fast path broke before it was answered: re-send it (gRPC or another path)."""


class Hold:
    """What a fast path resolves for a direct part (duck-types the Future methods _Path calls).
    inputs: the call as the shard saw it (for a re-send); a call sent from raw addresses (send_at)
    has its seq, slot and k instead, and inputs only once it failed."""

    __slots__ = ("res", "err", "fin", "inputs", "seq", "slot", "k")

    def __init__(self, k: int | None = None):
        self.res = self.err = self.inputs = self.seq = self.slot = None
        self.fin = False
        self.k = k

    def done(self) -> bool:
        return self.fin

    def set_result(self, res) -> None:
        self.res, self.fin = res, True

    def set_exception(self, err: BaseException) -> None:
        self.err, self.fin = err, True


class Part:
    """One group's share of a layer call: rows (None: every row), and either a direct Hold on
    replica r's fast path fp, or a Future of the client's failover."""

    __slots__ = ("rows", "group", "replica", "fp", "hold", "fut", "args", "t_send")

    def __init__(self, rows, group, args):
        self.rows, self.group, self.args = rows, group, args
        self.replica = self.fp = self.hold = self.fut = None
        self.t_send = 0.0


class LayerCall:
    """forward_async's answer: `result(timeout)` -> [T, H] float32, the parts summed in group order."""

    __slots__ = ("client", "layer", "T", "H", "parts")

    def __init__(self, client, layer: int, T: int, H: int, parts: list[Part]):
        self.client, self.layer, self.T, self.H, self.parts = client, layer, T, H, parts

    def done(self) -> bool:
        return all(p.hold.fin if p.fut is None else p.fut.done() for p in self.parts)

    def late(self) -> list[str]:
        """The groups (addresses) whose part has no answer yet."""
        return [p.group.addresses for p in self.parts if not (p.hold.fin if p.fut is None else p.fut.done())]

    def responses(self) -> list:
        """Each part's response (FastResponse / LayerResponse), after result()."""
        return [p.hold.res if p.fut is None else p.fut.result(0) for p in self.parts]

    def result(self, timeout: float | None = None) -> np.ndarray:
        end = None if timeout is None else time.monotonic() + timeout
        out = None  # [T, H] f32
        T, H = self.T, self.H
        for p in self.parts:
            resp = self._answer(p, end)
            y = array_of(resp.output)  # [T_s, H]
            want = (T if p.rows is None else len(p.rows), H)
            if y.shape != want:
                raise ShardError(p.group.addresses, None, f"layer {self.layer}: output shape {y.shape} != {want}")
            if out is None and p.rows is None:  # the first full answer is the sum so far (own copy)
                out = y if y.flags.writeable else y.copy()
                continue
            if out is None:
                out = np.zeros((T, H), dtype=np.float32)
            if p.rows is None:
                out += y
            else:
                out[p.rows] += y
        return out if out is not None else np.zeros((T, H), dtype=np.float32)  # no part: nothing routed

    def _answer(self, p: Part, end: float | None):
        """Part p's response, waiting (bounded by end); a failed direct part goes to the failover."""
        if p.fut is None:
            hold, fp = p.hold, p.fp
            while not hold.fin:
                if end is not None and time.monotonic() >= end:
                    raise FutureTimeout()
                if fp.usable:
                    fp.pump()  # receives the next answer on this doorbell (ours or another call's)
                else:
                    time.sleep(0.0001)  # it broke: the thread that saw it resolves every pending part
            self.client.observe_direct(self.layer, p, hold)
            if hold.err is None:
                return hold.res
            p.fut = self.client.resend(p, hold.err)
        return p.fut.result(None if end is None else max(0.0, end - time.monotonic()))
