"""GPU-side client of the CPU expert shards: routed-expert outputs for one MoE layer.

`ExpertsClient(addresses, cfg).connect()` asks every shard what it serves (Describe), refuses a
shard of another model (`FingerprintError`) and a set of shards that does not cover every
(MoE layer, expert, intermediate slice) exactly once (`CoverageError`). Then
`forward(layer, hidden, ids, w)` sends the rows each shard needs over one persistent bidi stream
per shard (requests fed by a queue, responses matched by seq), in parallel, and sums the partial
outputs. `forward_async` returns a `LayerCall` (gpu_service.experts.call) whose `result()` waits, so
the caller can compute the shared expert meanwhile: a part goes straight onto the picked replica's
fast path when it takes it, else (and when it fails) through the per-call failover below. numpy
in, numpy out; no torch here.

Reliability: addresses with identical coverage are replicas of one shard group (load spread
round-robin per call); a replica that fails mid-call is replaced by another for that call; every
layer call has a deadline (`timeout_s`, `--expert-timeout`); a group with no replica left fails
fast with ShardError(UNAVAILABLE); failed replicas are reconnected with capped exponential
backoff. Channels use model-sized message limits, keepalive pings and optional mutual TLS
(wire.channel). A connection re-opened to a shard restarted at its address (no failure seen) is
re-checked before its answers are used (gpu_service.experts.rejoin).

Fast paths: with `transport="auto"` (default) each replica is offered the shared-memory fast path
at connect (gpu_service.experts.shm; same host), else the TCP data path (gpu_service.experts.tcp;
any host, mTLS when the client has TLS); calls to a replica that accepted one go through it, everything else (and
every call after a fast-path failure) over the stream.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import ml_dtypes
import numpy as np

from checkpoint.config import ModelConfig
from checkpoint.names import compact_ranges
from gpu_service.experts.call import array_of, Hold, LayerCall, Moved, Part, WIRE_NP
from gpu_service.experts.errors import CoverageError, ExpertsClientError, FingerprintError, ShardError
from gpu_service.experts.fast import FastPaths
from gpu_service.experts.health import check_parallel, HealthCache
from gpu_service.experts.groups import _coverage_key, _Group, _Replica, check_coverage, check_returning, ShardDesc
from gpu_service.experts.rejoin import Rejoin
from gpu_service.experts.stream import _retryable, _ShardStream
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
from wire.channel import (
    add_tls_arguments, channel_credentials, channel_options, DEFAULT_MAX_TOKENS, host_of, make_channel, TLSFiles,
)

log = logging.getLogger("moesplit.experts_client")


class ExpertsClient:
    """Routed experts of every MoE layer, served by CPU shards at `addresses` (host:port).

    Addresses with identical Describe coverage are replicas of one shard group; coverage is
    checked over groups. A layer call goes to the group's healthy replicas round-robin; when a
    replica fails (stream error, UNAVAILABLE, no answer within `timeout_s`), the call is re-sent to
    another replica of the group (layer calls are idempotent). A group with no healthy replica
    fails the call at once with ShardError(UNAVAILABLE) naming the group. A supervisor thread
    enforces the deadlines and reconnects failed replicas (fresh channel, Describe) with capped
    exponential backoff, so a shard that comes back at its address is used again by itself."""

    def __init__(self, addresses: list[str], cfg: ModelConfig, timeout_s: float = 5.0, wire_dtype: str = "float32",
                 tls: TLSFiles | None = None, connect_timeout_s: float | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, tls_server_name: str | None = None,
                 reconnect_max_s: float = 5.0, transport: str = "auto", shm_dir: str | None = None):
        if not addresses:
            raise ValueError("ExpertsClient needs at least one shard address")
        if wire_dtype not in WIRE_NP:
            raise ValueError(f"wire_dtype {wire_dtype!r}: expected one of {list(WIRE_NP)}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.addresses = list(addresses)
        self.cfg = cfg
        self.timeout_s = float(timeout_s)  # deadline of one layer call on one replica
        self.connect_timeout_s = float(connect_timeout_s if connect_timeout_s is not None else max(timeout_s, 30.0))
        self.wire_dtype = wire_dtype
        self.tls = tls
        self.reconnect_max_s = float(reconnect_max_s)
        self._options = channel_options(cfg, max_tokens, tls_server_name)
        self._creds = channel_credentials(tls) if tls is not None else None
        self.shards: list[ShardDesc] = []  # one per group (its first replica's Describe)
        self.groups: list[_Group] = []
        self.replicas: list[_Replica] = []
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.failovers = 0  # layer calls re-sent to another replica
        # optional per-call hook (gpu_service.metrics.ExpertsObserver):
        # observer(layer, replica address, rtt seconds, bytes sent, bytes received, ok)
        self.observer = None
        # layer calls off the gRPC stream: shared memory with co-located shards (gpu_service.experts.shm),
        # else the TCP data path (gpu_service.experts.tcp; mTLS when `tls`); transport "auto"
        # (the first a shard accepts), "grpc" (never), "shm" / "tcp" (required)
        self.fast = FastPaths(transport, shm_dir, wire_dtype, tls=tls, tls_server_name=tls_server_name,
                              tcp_max_tokens=max_tokens)
        self._wire_np = np.dtype(WIRE_NP[wire_dtype])
        self.rejoin = Rejoin(self)  # a replica's connection showing a new process: re-checked before use
        self.fast.verify = self.rejoin.check

    # ---- set-up -------------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.Channel:
        return make_channel(address, self._options, creds=self._creds)

    def connect(self) -> "ExpertsClient":
        """Describe every address (in parallel), group replicas, check fingerprint and coverage.
        Unreachable addresses are fine if the reachable ones cover the model (replicas down)."""
        self.close()
        reps = [_Replica(a) for a in self.addresses]
        pending = []
        for r in reps:
            r.channel = self._channel(r.address)
            stub = experts_pb2_grpc.ExpertServiceStub(r.channel)
            pending.append(stub.Describe.future(experts_pb2.DescribeRequest(), timeout=self.connect_timeout_s,
                                                wait_for_ready=True))
        try:
            down: list[ShardError] = []
            for r, f in zip(reps, pending):
                try:
                    info = f.result()
                except grpc.RpcError as e:
                    err = ShardError(r.address, e.code(), f"Describe failed: {e.details()}")
                    r.last_error, r.next_try = str(err), time.monotonic()
                    r.channel.close()
                    r.channel = None
                    down.append(err)
                    continue
                self._attach(r, self.admit(r, info), groups_fixed=False, groups=self.groups)
            try:
                if not self.groups:
                    raise CoverageError("no expert shard answered", [], [])
                check_coverage(self.cfg, [g.desc for g in self.groups])
            except CoverageError as e:
                if down:  # the gap is probably the unreachable shards': say so first
                    first = down[0]
                    raise ShardError(",".join(d.address for d in down), first.code,
                                     f"{first.details}; the reachable shards do not cover the model: {e}") from None
                raise
        except BaseException:
            for r in reps:
                if r.channel is not None:
                    r.channel.close()
            self.groups = []
            raise
        self.replicas = reps
        self.shards = [g.desc for g in self.groups]
        self.whole = all(d.all_experts for d in self.shards)  # every group gets every row of every call
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, args=(self._stop,), name="experts-supervisor",
                                            daemon=True)
        self._supervisor.start()
        self.fast.attach_all(self.replicas, self.cfg)
        if down:
            log.warning("expert shards %s unreachable at start; serving from their replicas, reconnecting",
                        ", ".join(d.address for d in down))
        return self

    def _attach(self, r: _Replica, desc: ShardDesc, groups_fixed: bool, groups: list[_Group]) -> None:
        """Put a replica whose Describe was admitted (`admit`) into its group (a new group only at connect)."""
        info = desc.info
        key = _coverage_key(info)
        g = next((g for g in groups if g.key == key), None)
        if g is None:
            if groups_fixed:
                raise CoverageError(
                    f"expert shard {r.address} serves experts {compact_ranges(desc.experts)}, intermediate "
                    f"[{info.intermediate_start}:{info.intermediate_stop}), which matches no shard group of this "
                    "GPU service; it is not used", [], [])
            g = _Group(desc, self.cfg)
            groups.append(g)
        else:
            g.check_equivalent(r.address, info)
        r.desc, r.group = desc, g
        if r not in g.replicas:
            g.replicas.append(r)
        r.instance = info.instance_id
        r.stream = _ShardStream(r.address, experts_pb2_grpc.ExpertServiceStub(r.channel),
                                lambda inst, r=r: self.rejoin.check(r, inst))
        r.healthy, r.backoff_s, r.last_error = True, 0.0, ""

    def admit(self, r: _Replica, info: experts_pb2.ShardInfo) -> ShardDesc:
        """Check replica r's Describe answer `info` before the client uses it (at connect, on the
        supervisor's reconnect, on a restart Rejoin saw) and return r's new ShardDesc; r is not changed.
        Raises FingerprintError when the model fingerprint, hidden_size or n_routed_experts differ from
        the config's, and, only when r was described before, CoverageError (groups.check_returning) when
        its experts, --act-bits or kernel differ from then. The group's equivalence rule stays with the
        callers (_attach, Rejoin), which know r's group."""
        addr, want = r.address, self.cfg.fingerprint()
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
        if r.desc is not None:
            check_returning(addr, r.desc.info, info)
        ex = np.array(sorted(info.experts), dtype=np.int64)
        return ShardDesc(addr, info, ex, len(ex) == self.cfg.n_routed_experts)

    def __enter__(self) -> "ExpertsClient":
        return self.connect() if not self.shards else self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._health is not None:
            self._health.close()
            self._health = None
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(2.0)
        self._supervisor = None
        self.fast.close()
        for r in self.replicas:
            if r.stream is not None:
                r.stream.close()
            if r.channel is not None:
                r.channel.close()
        self.replicas, self.groups, self.shards = [], [], []

    # ---- health and reconnection --------------------------------------------------------------
    def _mark_down(self, r: _Replica, err: BaseException) -> None:
        with self._lock:
            was = r.healthy
            r.healthy = False
            r.last_error = str(err)
            if was:
                r.backoff_s = 0.0
                r.next_try = time.monotonic()  # first reconnect attempt right away, then back off
        if was:
            log.warning("expert shard %s failed (%s); using its replicas, reconnecting", r.address, err)

    def _supervise(self, stop: threading.Event) -> None:
        """Deadlines of in-flight calls (every ~50 ms) and reconnect attempts of failed replicas."""
        tick = min(0.05, self.timeout_s / 10)
        while not stop.wait(tick):
            now = time.monotonic()
            for r in list(self.replicas):
                if r.healthy and r.stream is not None and r.stream.expire(now):
                    self._mark_down(r, ShardError(r.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                  f"no answer within {self.timeout_s}s"))
                if not r.healthy and not r.probing and r.refused is None and now >= r.next_try:
                    self._probe(r)

    def _probe(self, r: _Replica) -> None:
        """Reconnect attempt: a fresh channel (re-resolves the name) and a Describe, asynchronously."""
        r.probing = True
        stop = self._stop
        ch = self._channel(r.address)
        f = experts_pb2_grpc.ExpertServiceStub(ch).Describe.future(
            experts_pb2.DescribeRequest(), timeout=min(2.0, self.timeout_s), wait_for_ready=True)

        def done(f):
            if stop.is_set():  # the client closed meanwhile
                ch.close()
                return
            try:
                desc = self.admit(r, f.result())
            except (grpc.RpcError, ExpertsClientError) as e:
                ch.close()
                if isinstance(e, (FingerprintError, CoverageError)):
                    r.refused = str(e)
                    log.error("%s", e)
                with self._lock:
                    r.backoff_s = min(self.reconnect_max_s, max(0.1, r.backoff_s * 2))
                    r.next_try = time.monotonic() + r.backoff_s * random.uniform(0.8, 1.2)
                    r.last_error = str(e) if not isinstance(e, grpc.RpcError) else f"{e.code().name}: {e.details()}"
                    r.probing = False
                return
            old_ch, old_stream = r.channel, r.stream
            with self._lock:
                r.channel = ch
                try:
                    self._attach(r, desc, groups_fixed=True, groups=self.groups)
                except CoverageError as e:
                    r.refused = str(e)
                    log.error("%s", e)
                r.probing = False
            if old_stream is not None:
                old_stream.close()
            if old_ch is not None:
                old_ch.close()
            if r.refused is None:
                log.info("expert shard %s is back", r.address)

        f.add_done_callback(done)

    _health: HealthCache | None = None

    def health(self, timeout_s: float = 1.0) -> tuple[bool, dict]:
        """grpc.health.v1 of every replica (over its own, possibly TLS, channel). Healthy when every
        shard group has a SERVING replica that the client also considers usable.

        The checks run in parallel every second on a background thread (started by the first call,
        which waits for it); a call answers from that in milliseconds, with the client's own view
        (a replica whose call just failed) applied at once."""
        if self._health is None:
            self._health = HealthCache(lambda: check_parallel({r.address: r.channel for r in self.replicas},
                                                              timeout_s))
        checked = self._health.get(timeout_s + 1.0)
        out: dict[str, str] = {}
        for r in self.replicas:
            if r.channel is None:
                out[r.address] = f"UNAVAILABLE: {r.last_error}"
                continue
            status = checked.get(r.address, "UNKNOWN: not checked yet")
            if status == "SERVING" and not r.healthy:  # (refused: serves something this GPU service cannot use)
                status = f"REFUSED: {r.refused}" if r.refused else f"RECONNECTING: {r.last_error}"
            out[r.address] = status
        ok = bool(self.groups) and all(any(out.get(r.address) == "SERVING" for r in g.replicas) for g in self.groups)
        return ok, out

    def replica_labels(self, address: str) -> tuple[str, str]:
        """(host, replica) for metrics: the host this client dials and the shard's own id (Describe's
        shard_id, stable across restarts; the address until the shard answered)."""
        r = next((r for r in self.replicas if r.address == address), None)
        name = r.desc.info.shard_id if r is not None and r.desc is not None and r.desc.info.shard_id else address
        return host_of(address), name

    # ---- compute ------------------------------------------------------------------------------
    def _pick(self, g: _Group, tried: list[_Replica], peek: bool = False) -> _Replica | None:
        """A healthy replica of g not in tried, round-robin (`peek`: the turn not taken; _Group.pick)."""
        return g.pick(tried, peek)

    def _call_group(self, g: _Group, layer: int, x, i, ww, failed: tuple | None = None,
                    first: _Replica | None = None) -> Future:
        """One layer call on group g: a replica (`first` if given), then another one if it fails
        (same request). failed: (replica, error) of a direct fast-path attempt already made
        (LayerCall): that failure is handled first, as if it had happened here."""
        out: Future = self.fast.future()  # waiting on it receives fast-path answers in place
        tensors: list = []  # encoded on the first gRPC send (the fast path does not need them)
        src = [x, i, ww]  # after a fast-path send: its copies in shared memory (the caller may reuse x)
        tried: list[_Replica] = []

        def send_grpc(r: _Replica) -> tuple[Future, int]:
            if not tensors:
                tensors.extend((_tensor(src[0], self.wire_dtype), _tensor(src[1], "int64"),
                                _tensor(src[2], "float32")))
            req = experts_pb2.LayerRequest(seq=next(self._seq), layer=layer, hidden=tensors[0],
                                           topk_ids=tensors[1], topk_weights=tensors[2])
            try:
                f = r.stream.send(req, self.timeout_s)
            except Exception as e:  # noqa: BLE001 - e.g. the channel was closed under us
                f = Future()
                f.set_exception(ShardError(r.address, grpc.StatusCode.UNAVAILABLE, repr(e)))
            return f, req.ByteSize()

        def send_unary(r: _Replica) -> Future:
            """ForwardOne: for a shard whose stream slots are all taken (RESOURCE_EXHAUSTED)."""
            req = experts_pb2.LayerRequest(seq=next(self._seq), layer=layer, hidden=tensors[0],
                                           topk_ids=tensors[1], topk_weights=tensors[2])
            f: Future = Future()
            experts_pb2_grpc.ExpertServiceStub(r.channel).ForwardOne.future(req, timeout=self.timeout_s) \
                .add_done_callback(lambda g: self.rejoin.unary_done(r, g, f))
            return f
        errors: list[str] = []
        unary_tried: list[_Replica] = []

        def attempt(r: _Replica | None = None):
            r = r or self._pick(g, tried)
            if r is None:
                why = "; ".join(errors) or "; ".join(f"{x.address}: {x.last_error}" for x in g.replicas)
                out.set_exception(ShardError(g.addresses, grpc.StatusCode.UNAVAILABLE,
                                             f"layer {layer}: no healthy replica of {g.label()} left ({why})"))
                return
            tried.append(r)
            if len(tried) > 1:
                self.failovers += 1
            t_send = time.perf_counter()
            f = self.fast.send(r, self.cfg, layer, *src, self.timeout_s, lambda r=r: send_grpc(r)[0])
            if f is not None:  # shared-memory fast path; falls back to the stream if it breaks
                sent = x.nbytes + i.nbytes + ww.nbytes
                if not tensors:
                    src[:] = f.inputs
            else:
                f, sent = send_grpc(r)
            if self.observer is not None:
                _observe(self.observer, f, layer, r.address, sent, t_send)
            f.add_done_callback(lambda f, r=r: finished(r, f))

        def finished(r: _Replica, f: Future):
            e = f.exception()
            if e is None:
                out.set_result(f.result())
            elif (isinstance(e, ShardError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and tensors
                  and r not in unary_tried and r.channel is not None):
                unary_tried.append(r)  # the shard's stream slots are taken: this call as a unary RPC
                send_unary(r).add_done_callback(lambda f, r=r: finished(r, f))
            elif _retryable(e) and not self._stop.is_set():
                self._mark_down(r, e)
                errors.append(f"{r.address}: {e.code.name}: {e.details}")
                attempt()
            else:
                out.set_exception(e)

        if failed is None:
            attempt(first)
        else:
            tried.append(failed[0])
            f0: Future = Future()
            f0.set_exception(failed[1])
            finished(failed[0], f0)
        return out

    def resend(self, p: Part, err: BaseException) -> Future:
        """A direct part that failed (LayerCall): through the failover with the inputs the shard saw;
        a part whose fast path broke (Moved) over gRPC to the same replica first (as a Future's
        fallback would be), then the failover."""
        if isinstance(err, Moved):
            return self._call_group(p.group, p.args[0], *p.hold.inputs, first=p.replica)
        return self._call_group(p.group, p.args[0], *p.hold.inputs, failed=(p.replica, err))

    def observe_direct(self, layer: int, p: Part, hold: Hold) -> None:
        """Report a direct part's answer (or failure) to the observer, as _observe does for the others."""
        if self.observer is not None and not isinstance(hold.err, Moved):
            x, i, ww = p.args[1:]
            ok = hold.err is None
            self.report(layer, p.replica.address, p.t_send, x.nbytes + i.nbytes + ww.nbytes,
                        hold.res.ByteSize() if ok else 0, ok)

    def report(self, layer: int, address: str, t_send: float, sent: int, received: int, ok: bool) -> None:
        """One call to one replica, sent at t_send (perf_counter), to the observer if there is one."""
        if self.observer is None:
            return
        try:
            self.observer(layer, address, time.perf_counter() - t_send, sent, received, ok)
        except Exception:  # noqa: BLE001 - metrics never break a forward
            pass

    def direct_route(self, row: list | None) -> list | None:
        """The (group, replica, direct fast path: shared memory, or TCP through its C client) of each
        part of a call whose parts all take every row, in group order: every group holds all experts
        (`whole`: any T, row unused), or
        `row` (T == 1: its expert ids) picks the groups holding one of them. None: the call goes
        through forward_async (a group without a usable fast path, rows split between groups,
        nothing routed)."""
        out = []
        E = self.cfg.n_routed_experts
        for g in self.groups:
            if not g.desc.all_experts:
                if row is None or not row or min(row) < 0 or max(row) >= E:
                    return None
                held = _mask(g.desc, E)
                if not any(held[e] for e in row):
                    continue
            r = self._pick(g, [], peek=True)  # a call that does not go this way must not take the turn
            entry = None if r is None else self.fast.paths.get(r.address)
            if entry is None or entry[0] is None or not entry[0].direct or not entry[0].usable \
                    or entry[1] is not r.stream:
                return None
            out.append((g, r, entry[0]))
        for g, _, _ in out:
            g.advance()
        return out or None

    def fail_over(self, layer: int, g: _Group, r: _Replica, hold: Hold, inputs: tuple) -> np.ndarray:
        """A direct call's part that failed on replica r (hold.err): the failover's answer [T, H]
        float32, as a LayerCall's part would get it (bounded by max_wait_s)."""
        p = Part(None, g, (layer, *inputs))
        p.replica, p.hold = r, hold
        hold.inputs = inputs
        f = self.resend(p, hold.err)
        try:
            return array_of(f.result(self.max_wait_s).output)
        except FutureTimeout:
            raise ShardError(g.addresses, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"layer {layer}: no answer within {self.max_wait_s:.1f}s") from None

    def _start(self, g: _Group, layer: int, rows, x, i, ww) -> Part:
        """Group g's part of a layer call: straight onto the picked replica's fast path when it
        takes it, else through the failover (_call_group)."""
        p = Part(rows, g, (layer, x, i, ww))
        r = self._pick(g, [])
        if r is not None:
            hold = Hold()
            p.t_send = time.perf_counter()
            if self.fast.send(r, self.cfg, layer, x, i, ww, self.timeout_s, None, hold) is not None:
                p.replica, p.fp, p.hold = r, self.fast.paths[r.address][0], hold
                return p
        p.fut = self._call_group(g, layer, x, i, ww, first=r)  # (r over gRPC: its stream, or its failure)
        return p

    @property
    def max_wait_s(self) -> float:
        """Longest a layer call can take: every replica of a group tried, each up to the deadline."""
        n = max((len(g.replicas) for g in self.groups), default=1)
        return self.timeout_s * n + 1.0

    def forward_async(self, layer: int, hidden: np.ndarray, ids: np.ndarray, w: np.ndarray) -> LayerCall:
        """Start the layer's routed experts on the shards; `result()` of the answer is [T, H] float32."""
        if not self.groups:
            raise ExpertsClientError("ExpertsClient.forward before connect()")
        # hidden may come already in the wire dtype (the runner casts on its device): no second cast
        hidden = np.ascontiguousarray(hidden, dtype=None if hidden.dtype == self._wire_np else np.float32)  # [T, H]
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # [T, k]
        w = np.ascontiguousarray(w, dtype=np.float32)  # [T, k]
        if hidden.ndim != 2 or ids.ndim != 2 or ids.shape != w.shape or ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"forward: expected hidden [T, H], ids [T, k], w [T, k]; got {hidden.shape}, {ids.shape}, {w.shape}"
            )
        T, H = hidden.shape
        parts: list[Part] = []
        if T == 0:
            return LayerCall(self, layer, T, H, parts)
        E = self.cfg.n_routed_experts
        one = T == 1 and 0 < ids.size <= 64  # decode: k Python ints are cheaper than numpy calls per group
        row = ids[0].tolist() if one else None
        if one:
            in_range = min(row) >= 0 and max(row) < E
        else:  # (k = 0: nothing routed, no shard called, zeros)
            in_range = bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < E))
        for g in self.groups:
            shard = g.desc
            if shard.all_experts:
                rows = None  # every row
            elif one and in_range:
                held = _mask(shard, E)
                if not any(held[e] for e in row):
                    continue
                rows = None
            else:
                hit = (_mask(shard, E)[ids] if in_range else np.isin(ids, shard.experts)).any(axis=1)  # [T]
                if not hit.any():
                    continue
                rows = None if hit.all() else np.nonzero(hit)[0]
            x, i, ww = (hidden, ids, w) if rows is None else (hidden[rows], ids[rows], w[rows])
            parts.append(self._start(g, layer, rows, x, i, ww))
        return LayerCall(self, layer, T, H, parts)

    def result(self, call: LayerCall, layer: int | None = None) -> np.ndarray:
        """Wait for a `forward_async` call, bounded: never longer than `max_wait_s`."""
        try:
            return call.result(timeout=self.max_wait_s)
        except FutureTimeout:
            late = call.late()
            raise ShardError(
                ",".join(late) or ",".join(self.addresses), grpc.StatusCode.DEADLINE_EXCEEDED,
                f"layer {layer}: no answer within {self.max_wait_s:.1f}s",
            ) from None

    def forward(self, layer: int, hidden: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Routed-expert output of MoE layer `layer`: [T, H] float32 (sum over the shards)."""
        return self.result(self.forward_async(layer, hidden, ids, w), layer)


def _mask(shard: ShardDesc, n_experts: int) -> np.ndarray:
    """[n_experts] bool: the routed experts this shard holds (a table lookup per call; np.isin costs
    ~50 µs a call). Made once per shard."""
    mask = getattr(shard, "_mask", None)
    if mask is None:
        mask = np.zeros(n_experts, dtype=bool)
        mask[shard.experts] = True
        shard._mask = mask
    return mask


def _observe(observer, fut: Future, layer: int, address: str, sent: int, t_send: float) -> None:
    """Report one call to one replica to `observer` when its answer (or failure) arrives."""
    def done(f: Future) -> None:
        rtt = time.perf_counter() - t_send
        ok = f.exception() is None
        try:
            observer(layer, address, rtt, sent, f.result().ByteSize() if ok else 0, ok)
        except Exception:  # noqa: BLE001 - metrics never break a forward
            pass

    fut.add_done_callback(done)


def add_expert_client_arguments(p: "argparse.ArgumentParser") -> None:
    """Flags of the GPU side's experts client (serve, gpu-server, generate)."""
    p.add_argument("--expert-timeout", type=float, default=5.0,
                   help="deadline in seconds of one MoE layer call on one shard replica (default 5); a request "
                        "whose shard has no replica left fails with 503 / UNAVAILABLE")
    add_tls_arguments(p, "client")


def expert_client_tls(args: "argparse.Namespace", prog: str):
    """TLSFiles from --tls-* (None without them); ValueError when only some are given."""
    return TLSFiles.from_args(args.tls_cert, args.tls_key, args.tls_ca, prog)


def _tensor(a: np.ndarray, dtype: str) -> experts_pb2.Tensor:
    np_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "int64": np.int64}[dtype]
    arr = np.ascontiguousarray(a, dtype=np_dt)
    return experts_pb2.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())
