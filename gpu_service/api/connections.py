"""Connection-level limits of the HTTP server (uvicorn + h11) and the gRPC server options.

uvicorn's `limit_concurrency` is one global, path-blind count (a flood of idle sockets turned /live
into 503) and h11 has no timers. So the protocol here adds, on the event loop's thread with O(1)
work per event: a header deadline, a body deadline with a minimum rate (then 408), a cap per client
address and one in total (evicting the oldest idle connection first), and room kept for /live and
/health (`ProbeReserve`). The gRPC server gets the same from grpc core's options
(`grpc_server_options`). Flags and defaults: docs/reliability.md.
"""
from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("moesplit.http")

PROBE_PATHS = ("/live", "/health")  # what the reserved connections are kept for
EVICT_AFTER_S = 0.5  # idle this long before eviction: a fresh connection's request may still be unread


def _error(message: str, code: str) -> bytes:
    """An OpenAI-shaped error body."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection (written before h11 has seen a request)."""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: 1\r\nconnection: close\r\n\r\n").encode() + body


class ConnectionTable:
    """The open HTTP connections (oldest first) and how many each client address holds.
    Touched only from the event loop's thread, so no lock."""

    def __init__(self, limits):
        """`limits`: a gpu_service.api.guard.ServerLimits."""
        self.limits = limits
        self.open: dict = {}  # protocol -> client host; insertion order = age
        self.by_client: dict[str, int] = {}
        self.refused = self.evicted = 0

    def admit(self, proto, host: str) -> str | None:
        """Register `proto`; None, or why it is refused (it is then not registered)."""
        lim = self.limits
        per_client = lim.max_connections_per_client
        if per_client and self.by_client.get(host, 0) >= per_client:
            self.refused += 1
            return (f"too many connections from {host}: at most {per_client} per client address "
                    f"(--max-connections-per-client); reuse connections (keep-alive) or wait")
        if len(self.open) >= lim.max_connections - lim.probe_connections:
            self._evict_idle(EVICT_AFTER_S)  # keep the probes' room free of idle connections while any can go
        if len(self.open) >= lim.max_connections and not self._evict_idle(0.0):  # full: the oldest idle goes
            self.refused += 1
            return (f"the server holds {len(self.open)} connections, its limit (--max-connections); "
                    f"retry shortly")
        self.open[proto] = host
        self.by_client[host] = self.by_client.get(host, 0) + 1
        return None

    def release(self, proto) -> None:
        """Forget `proto` (its connection is gone)."""
        host = self.open.pop(proto, None)
        if host is not None:
            left = self.by_client[host] - 1
            if left:
                self.by_client[host] = left
            else:
                del self.by_client[host]

    def _evict_idle(self, min_idle_s: float = EVICT_AFTER_S) -> bool:
        """Close the oldest connection with no request in progress for `min_idle_s`; False when
        there is none. O(open connections), only when the table is nearly full."""
        before = time.monotonic() - min_idle_s
        for proto in self.open:
            if proto.idle() and proto.idle_since <= before:
                self.release(proto)  # now, not at connection_lost: the newcomer takes its place
                proto.transport.close()
                self.evicted += 1
                return True
        return False

    def probes_only(self) -> bool:
        """True when only /live and /health may still be served: the reserved room is in use by
        connections with requests in progress (idle ones are evicted first)."""
        room = self.limits.max_connections - self.limits.probe_connections
        while len(self.open) > room and self._evict_idle():
            pass
        # idle ones left (too fresh to evict) hold nothing: count the connections with a request
        return len(self.open) > room and sum(not p.idle() for p in self.open) > room


class ProbeReserve:
    """ASGI wrapper: 503 for anything but /live and /health while the reserved room is in use."""

    def __init__(self, app, table: ConnectionTable):
        """Wrap `app`; `table`: the server's ConnectionTable."""
        self.app, self.table = app, table

    async def __call__(self, scope, receive, send):
        """Pass through, unless connections are short and this is not a probe."""
        if scope["type"] == "http" and self.table.probes_only() and scope["path"] not in PROBE_PATHS:
            lim = self.table.limits
            body = _error(f"the server holds {len(self.table.open)} connections; the last "
                          f"{lim.probe_connections} of --max-connections ({lim.max_connections}) are kept "
                          f"for /live and /health (--probe-connections); retry shortly", "too_many_connections")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def limited_protocol(limits, table: ConnectionTable):
    """uvicorn's H11Protocol with the header and body deadlines and the connection caps of
    `limits` (a ServerLimits), registering connections in `table`. Pass as `uvicorn.Config(http=...)`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    header_s, body_s, min_rate = limits.header_timeout_s, limits.body_timeout_s, float(limits.body_min_rate)

    class LimitedH11(H11Protocol):
        """H11Protocol + deadlines + caps (see the module docstring)."""

        _timer = None  # the header or the body deadline, whichever applies now
        _admitted = False
        _body_t0 = 0.0
        _body_bytes = 0

        idle_since = 0.0  # when the connection was last made idle (connected, or a response completed)

        def idle(self) -> bool:
            """No request in progress: headers not (all) in, and no response being sent."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _arm_header(self) -> None:
            if self._timer is None and self.idle() and not self.transport.is_closing():
                self.idle_since = time.monotonic()
                self._timer = self.loop.call_later(header_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._timer = None
            if self.idle() and not self.transport.is_closing():
                self.transport.close()  # headers not complete in time (slowloris / half-open)

        def _arm_body(self) -> None:
            self._body_t0, self._body_bytes = time.monotonic(), 0
            self._timer = self.loop.call_later(body_s, self._body_deadline)

        def _body_deadline(self) -> None:
            self._timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            if self.flow.read_paused:  # we stopped reading (the app is behind): not the client's fault
                return self._arm_body()
            allowed = self._body_t0 + body_s + self._body_bytes / min_rate
            left = allowed - time.monotonic()
            if left > 0:
                self._timer = self.loop.call_later(left, self._body_deadline)
                return
            self._close_slow_body()

        def _close_slow_body(self) -> None:
            """408 naming the limits when no response has started, then close."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                body = _error(f"the request body did not arrive in time: {body_s:g} s plus 1 s per "
                              f"{int(min_rate)} bytes (--body-timeout, --body-min-rate); got "
                              f"{self._body_bytes} bytes", "request_timeout")
                try:
                    out = self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")]))
                    self.transport.write(out + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
                except h11.LocalProtocolError:
                    pass
            if cycle is not None:  # the app's read ends with http.disconnect, its writes are dropped
                cycle.response_started = cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            host = self.client[0] if self.client else "?"
            why = table.admit(self, host)
            if why is not None:
                self.connections.discard(self)
                transport.write(_raw_response(503, "Service Unavailable", _error(why, "too_many_connections")))
                transport.close()
                return
            self._admitted = True
            self._arm_header()

        def data_received(self, data: bytes) -> None:
            if not self._admitted:
                return
            was_body = self.conn.their_state is h11.SEND_BODY
            super().data_received(data)
            state = self.conn.their_state
            if was_body:
                self._body_bytes += len(data)
            if state is h11.SEND_BODY:
                if not was_body:  # headers complete, body to come
                    self._cancel()
                    self._arm_body()
            elif state is not h11.IDLE:
                self._cancel()  # the request is whole: the app's now
            elif self._timer is None:
                self._arm_header()  # the next request on a kept-alive connection started arriving

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if (self.conn.their_state is h11.SEND_BODY and self.cycle is not None and not self.transport.is_closing()
                    and self.cycle.scope.get("method") in ("GET", "HEAD")):  # a body where none belongs: don't drain it
                self._cancel()
                self.transport.close()
                return
            if self.conn.their_state is h11.IDLE:
                self._cancel()
                self._arm_header()

        def connection_lost(self, exc) -> None:
            self._cancel()
            if self._admitted:
                table.release(self)
            super().connection_lost(exc)

    return LimitedH11


def grpc_server_options(limits) -> list[tuple[str, int]]:
    """grpc core options bounding what one client can hold on the Generate server (ServerLimits):
    streams per connection, handshake deadline, keepalive enforcement, idle connections closed."""
    return [
        ("grpc.max_concurrent_streams", limits.grpc_max_streams_per_connection),
        ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(limits.grpc_min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.keepalive_time_ms", 60_000),  # the server's own pings find dead peers
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.max_connection_idle_ms", int(limits.grpc_max_connection_idle_s * 1000)),
    ]
