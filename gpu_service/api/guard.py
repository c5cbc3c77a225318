"""Limits and authentication in front of the APIs: checked before any work is done.

- `ServerLimits`: body size (HTTP 413), prompt characters (checked before tokenizing), uvicorn's
  connection cap (`limit_concurrency`, 503 beyond it) and the header-read deadline.
- `Guard`: a pure ASGI middleware (not Starlette's `BaseHTTPMiddleware`, which hides the
  client's disconnect from the endpoint, so non-stream requests of clients that left were never
  cancelled): the API key on /v1 and the body-size cap, both before the app reads anything.
- `KeyCheck`: `Authorization: Bearer <key>` compared in constant time over sha256 digests, the
  scheme case-insensitive; shared by HTTP and the gRPC interceptor (`grpc_api`).
- `HeaderTimeoutH11`: uvicorn's h11 protocol with a deadline on reading a request's headers
  (uvicorn has none: half-open connections stayed open indefinitely).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: ~1M token ids as JSON, or a few million characters of prompt
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_LIMIT_CONCURRENCY = 1024  # open connections + running requests; uvicorn answers 503 beyond


@dataclass
class ServerLimits:
    """What the HTTP / gRPC front ends refuse before doing work (CLI: --max-body-bytes ...).
    `max_prompt_chars` None: 16 characters per token the engine can hold (`prompt_chars_for`)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY

    def prompt_chars_for(self, max_request_tokens: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 16 * max_request_tokens


KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what needs the API key (not /health, /live, /metrics)


class KeyCheck:
    """`Authorization: Bearer <key>`: scheme case-insensitive, key compared in constant time
    (sha256 digests, so neither the length nor a prefix of the key leaks through timing)."""

    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode()).digest()

    def ok(self, header: str | bytes | None) -> bool:
        if header is None:
            return False
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        scheme, _, token = header.strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(given, self._digest) and scheme.lower() == "bearer"


UNAUTHORIZED = "Incorrect API key provided: send 'Authorization: Bearer <key>' with the server's --api-key"


class BodyTooLarge(Exception):
    """The request body passed `ServerLimits.max_body_bytes` (HTTP 413)."""


def _error(message: str, type_: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


async def _respond(send, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Pure ASGI middleware: API key on /v1 paths, body-size cap on every request.

    A declared Content-Length over the cap is answered 413 before a byte of the body is read; a
    chunked body is counted as it arrives and the app's read fails with `BodyTooLarge` (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.keys = KeyCheck(api_key) if api_key is not None else None
        self.max_body = int(max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.keys is not None and scope["path"].startswith(KEYED_PATHS) and not self.keys.ok(headers.get(b"authorization")):
            return await _respond(send, 401, _error(UNAUTHORIZED, "invalid_request_error", "invalid_api_key"))
        limit = self.max_body
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _respond(send, 400, _error("bad Content-Length header", "invalid_request_error", None))
        if declared > limit:
            return await _respond(send, 413, _error(
                f"the request body has {declared} bytes; this server takes at most {limit} (--max-body-bytes)",
                "invalid_request_error", "request_too_large"), [(b"connection", b"close")])
        seen = 0

        async def capped_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"the request body passed {limit} bytes, this server's limit "
                                       f"(--max-body-bytes)")
            return msg

        return await self.app(scope, capped_receive, send)


def header_timeout_protocol(timeout_s: float):
    """uvicorn's H11Protocol with a deadline for a request's headers (connection open, headers not
    complete within timeout_s: closed). Pass as `uvicorn.Config(http=...)`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._header_timer = self.loop.call_later(timeout_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                self.transport.close()  # headers not complete in time (slowloris / half-open)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()  # headers complete: the request is the app's now
                self._header_timer = None
            elif self._header_timer is None and not self.transport.is_closing():
                self._arm()  # the next request on a kept-alive connection started arriving

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return HeaderTimeoutH11
