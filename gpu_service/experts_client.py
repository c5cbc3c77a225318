"""GPU-side client of the CPU expert shards: routed-expert outputs for one MoE layer.

`ExpertsClient(addresses, cfg).connect()` asks every shard what it serves (Describe), refuses a
shard of another model (`FingerprintError`) and a set of shards that does not cover every
(MoE layer, expert, intermediate slice) exactly once (`CoverageError`). Then
`forward(layer, hidden, ids, w)` sends the rows each shard needs over one persistent bidi stream
per shard (requests fed by a queue, responses matched by seq), in parallel, and sums the partial
outputs. `forward_async` returns a `concurrent.futures.Future` so the caller can compute the
shared expert meanwhile. numpy in, numpy out; no torch here.
"""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc
import ml_dtypes
import numpy as np

from checkpoint.config import ModelConfig
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
_WIRE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class ExpertsClientError(RuntimeError):
    """Base class of the experts client's errors."""


class ShardError(ExpertsClientError):
    """A shard failed a request; names the shard address and the gRPC status."""

    def __init__(self, address: str, code: grpc.StatusCode | None, details: str):
        self.address = address
        self.code = code
        self.details = details
        code_name = code.name if code is not None else "ERROR"
        super().__init__(f"expert shard {address}: {code_name}: {details}")


class FingerprintError(ExpertsClientError):
    """A shard serves a different model than the GPU service's config."""


class CoverageError(ExpertsClientError):
    """The shards do not cover every (layer, expert, intermediate slice) exactly once."""

    def __init__(self, message: str, missing: list, doubled: list):
        super().__init__(message)
        self.missing = missing  # [(layer, expert, i0, i1)]
        self.doubled = doubled  # [(layer, expert, i0, i1, [addresses])]


@dataclass
class ShardDesc:
    address: str
    info: experts_pb2.ShardInfo
    experts: np.ndarray  # sorted int64 ids held
    all_experts: bool  # holds every routed expert (slice shards): gets every row


# ---- coverage ---------------------------------------------------------------------------------
def _ranges(vals) -> str:
    vals = sorted(set(int(v) for v in vals))
    out, i = [], 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out)


def _describe_cells(cells: list[tuple[int, int, int, int]], intermediate: int) -> list[str]:
    """[(layer, expert, i0, i1)] -> ['experts 8-15 in layers 1-2', 'intermediate [0:64) of expert 3 in layer 1']."""
    by_range: dict[tuple[int, int], dict[int, set[int]]] = {}
    for layer, e, i0, i1 in cells:
        by_range.setdefault((i0, i1), {}).setdefault(layer, set()).add(e)
    out = []
    for (i0, i1), layers in sorted(by_range.items()):
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer, es in layers.items():
            groups.setdefault(tuple(sorted(es)), []).append(layer)
        for es, ls in sorted(groups.items(), key=lambda kv: min(kv[1])):
            what = f"expert{'s' if len(es) > 1 else ''} {_ranges(es)}"
            if (i0, i1) != (0, intermediate):
                what = f"intermediate [{i0}:{i1}) of {what}"
            out.append(f"{what} in layer{'s' if len(ls) > 1 else ''} {_ranges(ls)}")
    return out


def check_coverage(cfg: ModelConfig, shards: list[ShardDesc]) -> None:
    """Every MoE layer x expert x intermediate position served exactly once, else CoverageError."""
    I = cfg.moe_intermediate_size
    # (layer, expert) -> [(i0, i1, address)]
    held: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for s in shards:
        i0, i1 = int(s.info.intermediate_start), int(s.info.intermediate_stop)
        for layer in s.info.layers:
            for e in s.info.experts:
                held.setdefault((int(layer), int(e)), []).append((i0, i1, s.address))
    missing: list[tuple[int, int, int, int]] = []
    doubled: list[tuple[int, int, int, int, list[str]]] = []
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            pieces = held.get((layer, e), [])
            bounds = sorted({0, I, *(p for a, b, _ in pieces for p in (a, b) if 0 <= p <= I)})
            for a, b in zip(bounds[:-1], bounds[1:]):
                owners = [addr for i0, i1, addr in pieces if i0 <= a and b <= i1]
                if not owners:
                    missing.append((layer, e, a, b))
                elif len(owners) > 1:
                    doubled.append((layer, e, a, b, owners))
    extra = sorted({(int(l), s.address) for s in shards for l in s.info.layers if not cfg.is_moe_layer(int(l))})
    if not missing and not doubled and not extra:
        return
    lines = []
    if missing:
        lines.append("missing " + "; ".join(_describe_cells(missing, I)))
    if doubled:
        by_owners: dict[tuple[str, ...], list] = {}
        for layer, e, a, b, owners in doubled:
            by_owners.setdefault(tuple(owners), []).append((layer, e, a, b))
        for owners, cells in by_owners.items():
            lines.append(f"doubled {'; '.join(_describe_cells(cells, I))} (served by {', '.join(owners)})")
    if extra:
        lines.append("shards serve non-MoE layers: " + ", ".join(f"{a} layer {l}" for l, a in extra))
    raise CoverageError(
        "expert shards do not cover every (MoE layer, expert, intermediate slice) exactly once: "
        + " | ".join(lines)
        + ". Fix the --experts / --slice of the shards.",
        missing,
        doubled,
    )


# ---- one persistent stream per shard -----------------------------------------------------------
class _ShardStream:
    """A bidi Forward stream fed by a queue; a reader thread resolves futures by seq.

    If the stream breaks (INVALID_ARGUMENT, UNAVAILABLE...), every pending future fails with a
    ShardError naming the shard, and the next request opens a new stream."""

    _CLOSE = object()

    def __init__(self, address: str, stub: experts_pb2_grpc.ExpertServiceStub):
        self.address = address
        self.stub = stub
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
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
            for resp in call:
                with self.lock:
                    fut = self.pending.pop(resp.seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.RpcError as e:
            err = ShardError(self.address, e.code(), e.details() or str(e))
        except Exception as e:  # noqa: BLE001 - surface anything on the waiting futures
            err = ShardError(self.address, None, repr(e))
        with self.lock:
            if self.call is call:  # this stream is finished; the next send opens a new one
                self.call, self.queue = None, None
            q.put(self._CLOSE)
            failed = list(self.pending.items())
            self.pending.clear()
        if err is None:
            err = ShardError(self.address, grpc.StatusCode.UNAVAILABLE, "stream closed by the shard")
        for _, fut in failed:
            if not fut.done():
                fut.set_exception(err)

    def send(self, req: experts_pb2.LayerRequest) -> Future:
        fut: Future = Future()
        with self.lock:
            if self.call is None:
                self._open()
            self.pending[req.seq] = fut
            self.queue.put(req)
        return fut

    def close(self) -> None:
        with self.lock:
            q, call = self.queue, self.call
            self.queue = self.call = None
        if q is not None:
            q.put(self._CLOSE)
        if call is not None:
            call.cancel()


class ExpertsClient:
    """Routed experts of every MoE layer, served by CPU shards at `addresses` (host:port)."""

    def __init__(self, addresses: list[str], cfg: ModelConfig, timeout_s: float = 30.0, wire_dtype: str = "float32"):
        if not addresses:
            raise ValueError("ExpertsClient needs at least one shard address")
        if wire_dtype not in _WIRE:
            raise ValueError(f"wire_dtype {wire_dtype!r}: expected one of {list(_WIRE)}")
        self.addresses = list(addresses)
        self.cfg = cfg
        self.timeout_s = float(timeout_s)
        self.wire_dtype = wire_dtype
        self.shards: list[ShardDesc] = []
        self._channels: list[grpc.Channel] = []
        self._streams: list[_ShardStream] = []
        self._seq = itertools.count(1)

    # ---- set-up -------------------------------------------------------------------------------
    def connect(self) -> "ExpertsClient":
        self.close()
        shards, chans, streams = [], [], []
        try:
            for addr in self.addresses:
                ch = grpc.insecure_channel(addr, options=GRPC_OPTIONS)
                chans.append(ch)
                stub = experts_pb2_grpc.ExpertServiceStub(ch)
                try:
                    info = stub.Describe(experts_pb2.DescribeRequest(), timeout=self.timeout_s, wait_for_ready=True)
                except grpc.RpcError as e:
                    raise ShardError(addr, e.code(), f"Describe failed: {e.details()}") from None
                self._check_shard(addr, info)
                ex = np.array(sorted(info.experts), dtype=np.int64)
                shards.append(ShardDesc(addr, info, ex, len(ex) == self.cfg.n_routed_experts))
                streams.append(_ShardStream(addr, stub))
            check_coverage(self.cfg, shards)
        except BaseException:
            for ch in chans:
                ch.close()
            raise
        self.shards, self._channels, self._streams = shards, chans, streams
        return self

    def _check_shard(self, addr: str, info: experts_pb2.ShardInfo) -> None:
        want = self.cfg.fingerprint()
        if info.model_fingerprint != want:
            raise FingerprintError(
                f"expert shard {addr} ({info.shard_id}) serves model fingerprint {info.model_fingerprint!r} "
                f"but this GPU service's config has {want!r}; start the shard with the same checkpoint"
            )
        if info.hidden_size != self.cfg.hidden_size or info.n_routed_experts != self.cfg.n_routed_experts:
            raise FingerprintError(
                f"expert shard {addr}: hidden_size/n_routed_experts {info.hidden_size}/{info.n_routed_experts} "
                f"!= config {self.cfg.hidden_size}/{self.cfg.n_routed_experts}"
            )

    def __enter__(self) -> "ExpertsClient":
        return self.connect() if not self.shards else self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self._streams:
            s.close()
        for ch in self._channels:
            ch.close()
        self._streams, self._channels, self.shards = [], [], []

    # ---- compute ------------------------------------------------------------------------------
    def forward_async(self, layer: int, hidden: np.ndarray, ids: np.ndarray, w: np.ndarray) -> Future:
        """Start the layer's routed experts on the shards; the future's result is [T, H] float32."""
        if not self.shards:
            raise ExpertsClientError("ExpertsClient.forward before connect()")
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)  # [T, H]
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # [T, k]
        w = np.ascontiguousarray(w, dtype=np.float32)  # [T, k]
        if hidden.ndim != 2 or ids.ndim != 2 or ids.shape != w.shape or ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"forward: expected hidden [T, H], ids [T, k], w [T, k]; got {hidden.shape}, {ids.shape}, {w.shape}"
            )
        T = hidden.shape[0]
        result: Future = Future()
        if T == 0:
            result.set_result(np.zeros_like(hidden))
            return result
        parts: list[tuple[np.ndarray | None, Future]] = []
        sent: list[ShardDesc] = []
        for shard, stream in zip(self.shards, self._streams):
            if shard.all_experts:
                rows = None  # every row
            else:
                hit = np.isin(ids, shard.experts).any(axis=1)  # [T]
                if not hit.any():
                    continue
                rows = None if hit.all() else np.nonzero(hit)[0]
            x, i, ww = (hidden, ids, w) if rows is None else (hidden[rows], ids[rows], w[rows])
            req = experts_pb2.LayerRequest(
                seq=next(self._seq),
                layer=layer,
                hidden=_tensor(x, self.wire_dtype),
                topk_ids=_tensor(i, "int64"),
                topk_weights=_tensor(ww, "float32"),
            )
            parts.append((rows, stream.send(req)))
            sent.append(shard)
        if not parts:
            result.set_result(np.zeros_like(hidden))
            return result

        remaining = [len(parts)]
        lock = threading.Lock()

        def _done(_f):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            if result.done():
                return
            out = np.zeros((T, hidden.shape[1]), dtype=np.float32)  # [T, H]
            try:
                for (rows, f), shard in zip(parts, sent):
                    resp = f.result()
                    y = _array(resp.output)  # [T_s, H]
                    want = (T if rows is None else len(rows), hidden.shape[1])
                    if y.shape != want:
                        raise ShardError(shard.address, None, f"layer {layer}: output shape {y.shape} != {want}")
                    if rows is None:
                        out += y
                    else:
                        out[rows] += y
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)
                return
            result.set_result(out)

        result.shard_futures = [(s.address, f) for s, (_, f) in zip(sent, parts)]
        for _, f in parts:
            f.add_done_callback(_done)
        return result

    def forward(self, layer: int, hidden: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Routed-expert output of MoE layer `layer`: [T, H] float32 (sum over the shards)."""
        fut = self.forward_async(layer, hidden, ids, w)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            late = [a for a, f in getattr(fut, "shard_futures", []) if not f.done()]
            raise ShardError(
                ",".join(late) or ",".join(s.address for s in self.shards), grpc.StatusCode.DEADLINE_EXCEEDED,
                f"layer {layer}: no answer within {self.timeout_s}s",
            ) from None


def _tensor(a: np.ndarray, dtype: str) -> experts_pb2.Tensor:
    np_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "int64": np.int64}[dtype]
    arr = np.ascontiguousarray(a, dtype=np_dt)
    return experts_pb2.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


def _array(t: experts_pb2.Tensor) -> np.ndarray:
    dt = _WIRE.get(t.dtype)
    if dt is None:
        raise ExpertsClientError(f"shard answered with dtype {t.dtype!r}")
    return np.frombuffer(t.data, dtype=dt).reshape(tuple(t.shape)).astype(np.float32)
