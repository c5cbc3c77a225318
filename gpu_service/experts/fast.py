"""The fast paths of one experts client: shared memory or the TCP data path per replica, else gRPC.

`FastPaths(mode, ...)` belongs to an `ExpertsClient`. At connect it offers every replica a shared
file + doorbell (`AttachShm`); a replica that accepts serves layer calls through shared memory,
one that refuses (another host, no shared directory, disabled, an old shard) stays on the gRPC
stream. Per call, `send()` returns None whenever the fast path cannot take it (not negotiated,
broken, more rows than a slot holds, every slot busy): the caller then uses gRPC. A fast path that
breaks mid-call (the doorbell socket fails) re-sends its pending calls over gRPC; the replica then
stays on gRPC until a fresh fast path is negotiated (when it reconnects, or, while its gRPC channel
still works, e.g. a shard restarted at the same address, after a back-off of RETRY_MIN_S doubling
to RETRY_MAX_S; a path accepted by a restarted shard process is used only once that process passed the
returning replica's checks: gpu_service.experts.rejoin); a refused call (INVALID_ARGUMENT) fails like gRPC's; a call
past its deadline fails with DEADLINE_EXCEEDED (the client then fails over to another replica).

mode: "grpc" never negotiates; "auto" offers shared memory, then the cross-host TCP data path
(gpu_service.experts.tcp; TLS when the client has TLS), and falls back silently (logged); "shm" / "tcp" insist on
that one: `connect()` fails if a replica refuses. numpy only, no torch.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from gpu_service.experts.errors import ExpertsClientError
from gpu_service.experts.path import _Path, DEFAULT_MAX_TOKENS, DEFAULT_SLOTS, DrivenFuture
from gpu_service.experts.shm import FastPath, negotiate
from gpu_service.experts.tcp import negotiate_tcp
from wire import shm as P

log = logging.getLogger("moesplit.shm")


MODES = ("auto", "grpc", "shm", "tcp")
RETRY_MIN_S, RETRY_MAX_S = 0.5, 8.0  # back-off of renegotiating a fast path that broke


class FastPaths:
    """The fast paths of one ExpertsClient, by replica address."""

    def __init__(self, mode: str = "auto", shm_dir: str | None = None, wire_dtype: str = "float32",
                 max_tokens: int = DEFAULT_MAX_TOKENS, n_slots: int = DEFAULT_SLOTS, tls=None,
                 tls_server_name: str | None = None, tcp_max_tokens: int = DEFAULT_MAX_TOKENS):
        if mode not in MODES:
            raise ValueError(f"transport {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.tls, self.tls_server_name = tls, tls_server_name  # TLSFiles: the TCP data path is TLS too
        self.tcp_max_tokens = int(tcp_max_tokens)  # rows per TCP call (the shard's --max-tokens bounds it too)
        self.shm_dir = shm_dir or P.default_dir()
        self.wire_dtype = wire_dtype
        self.max_tokens, self.n_slots = int(max_tokens), int(n_slots)
        self.paths: dict[str, tuple[FastPath | None, object]] = {}  # address -> (fast path, stream it went with)
        self.reasons: dict[str, str] = {}  # address -> why it is on gRPC
        self._renegotiating: set[str] = set()
        self._retry: dict[str, tuple[float, float]] = {}  # address -> (next try, back-off) after a break
        self._lock = threading.Lock()
        # verify(replica, instance id of the process that accepted a fast path): returns when it may be used,
        # else raises ShardError (gpu_service.experts.rejoin: a restarted shard is re-checked first)
        self.verify = None

    def _negotiate(self, r, cfg) -> tuple[_Path | None, str]:
        """Shared memory (same host), else the TCP data path (any host, not with TLS), else gRPC; a path
        accepted by another process than the one the client checked is used only once `verify` passes."""
        fp, why = self._offer(r, cfg)
        if fp is not None and self.verify is not None:
            try:
                self.verify(r, fp.instance)
            except ExpertsClientError as e:  # refused (or not re-checked): its answers must not be used
                fp.close()
                return None, f"{fp.kind}: {e}"
        return fp, why

    def _offer(self, r, cfg) -> tuple[_Path | None, str]:
        """The first fast path the shard accepts (shared memory, then TCP) or (None, why none)."""
        why = []
        if self.mode in ("auto", "shm"):
            fp, w = negotiate(r.channel, r.address, cfg.hidden_size, cfg.num_experts_per_tok, self.shm_dir,
                              self.wire_dtype, self.max_tokens, self.n_slots)
            if fp is not None:
                return fp, ""
            why.append(f"shm: {w}")
        if self.mode in ("auto", "tcp"):

            tp, w = negotiate_tcp(r.channel, r.address, cfg.hidden_size, self.wire_dtype, self.tcp_max_tokens,
                                  self.tls, self.tls_server_name)
            if tp is not None:
                return tp, "; ".join(why)  # (auto: why shared memory was refused)
            why.append(f"tcp: {w}")
        return None, "; ".join(why)

    def attach_all(self, replicas, cfg) -> None:
        """At connect: offer every healthy replica a fast path (in parallel)."""
        if self.mode == "grpc":
            return
        live = [r for r in replicas if r.healthy and r.channel is not None]
        results: dict[str, tuple] = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.address, self._negotiate(r, cfg)))
                   for r in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in live:
            fp, why = results[r.address]
            self._set(r, fp, why)
        refused = {a: w for a, w in self.reasons.items() if self.transport_of(a) != self.mode}
        if self.mode in ("shm", "tcp") and refused:
            self.close()
            what = "the shared-memory fast path" if self.mode == "shm" else "the TCP data path"
            raise ExpertsClientError(f"transport {self.mode!r}: {what} was refused by "
                                     + "; ".join(f"{a}: {w}" for a, w in refused.items()))

    def _set(self, r, fp: _Path | None, why: str) -> None:
        with self._lock:
            old = self.paths.get(r.address)
            self.paths[r.address] = (fp, r.stream)
            self.reasons[r.address] = why
        if old is not None and old[0] is not None and old[0] is not fp:
            old[0].close()
        if fp is not None:
            log.info("expert shard %s: %s", r.address, fp.describe())
        else:
            log.info("expert shard %s: gRPC transport (%s)", r.address, why)

    def drop(self, address: str, why: str) -> None:
        """Close the fast path to `address` (a replica refused): its calls go nowhere near it again."""
        with self._lock:
            old = self.paths.get(address)
            if old is not None:  # (kept as an entry without a path: a call that just took it finds its entry)
                self.paths[address] = (None, old[1])
            self.reasons[address] = why
        if old is not None and old[0] is not None:
            old[0].close()

    def transport_of(self, address: str) -> str:
        fp = self.paths.get(address, (None, None))[0]
        return fp.kind if fp is not None and fp.usable else "grpc"

    def send(self, r, cfg, layer: int, x, ids, w, timeout_s: float, fallback, hold=None):
        """A fast-path call to replica r (a Future, or `hold` resolved in its place), or None (use
        the gRPC stream)."""
        entry = self.paths.get(r.address)
        if entry is not None and entry[0] is not None and entry[0].usable and entry[1] is r.stream:
            return entry[0].send(layer, x, ids, w, timeout_s, fallback, hold)
        if self.mode != "grpc" and (entry is None or entry[1] is not r.stream):
            self._renegotiate(r, cfg)  # the replica reconnected since: offer it a fresh fast path
        elif self.mode != "grpc" and entry[0] is not None and not entry[0].usable and self._due(r.address):
            self._renegotiate(r, cfg)  # broke while gRPC still works (a restarted shard): try again, backing off
        return None

    def _due(self, address: str) -> bool:
        """Whether a broken fast path to `address` may be renegotiated now (and book the next try)."""
        now = time.monotonic()
        with self._lock:
            at, backoff = self._retry.get(address, (0.0, 0.0))
            if now < at or address in self._renegotiating:
                return False
            backoff = min(RETRY_MAX_S, max(RETRY_MIN_S, 2 * backoff))
            self._retry[address] = (now + backoff, backoff)
        return True

    def _renegotiate(self, r, cfg) -> None:
        with self._lock:
            if r.address in self._renegotiating:
                return
            self._renegotiating.add(r.address)

        def run():
            try:
                if r.channel is not None:
                    fp, why = self._negotiate(r, cfg)
                    self._set(r, fp, why)
            finally:
                with self._lock:
                    self._renegotiating.discard(r.address)

        threading.Thread(target=run, name=f"shm-negotiate-{r.address}", daemon=True).start()

    def future(self) -> Future:
        """A future for a layer call's combined result: waiting on it drives the fast paths."""
        return DrivenFuture(self) if self.mode != "grpc" else Future()

    def close(self) -> None:
        with self._lock:
            paths, self.paths = self.paths, {}
        for fp, _ in paths.values():
            if fp is not None:
                fp.close()
