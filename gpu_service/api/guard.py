"""Limits and authentication in front of the APIs: checked before any work is done.

- `ServerLimits`: body size (413), prompt characters, and the connection limits that
  gpu_service.api.connections applies;
- `Guard`: pure ASGI middleware (a `BaseHTTPMiddleware` would hide client disconnects from the
  endpoint): the API key on /v1 and the body-size cap, before the app reads anything;
- `KeyCheck`: `Authorization: Bearer <key>` compared in constant time, shared with gRPC.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: ~1M token ids as JSON, or a few million characters of prompt
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_BODY_MIN_RATE = 16 << 10  # bytes/s: each 16 KiB received adds 1 s to the body deadline
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 256  # behind an ingress every client is its address: raise it, or 0 (off)
DEFAULT_PROBE_CONNECTIONS = 32
DEFAULT_GRPC_STREAMS_PER_CONNECTION = 32
DEFAULT_GRPC_MIN_PING_INTERVAL_S = 10.0
DEFAULT_GRPC_MAX_CONNECTION_IDLE_S = 300.0


@dataclass
class ServerLimits:
    """What the HTTP / gRPC front ends refuse before doing work; flags and defaults in
    docs/reliability.md. `max_prompt_chars` None: 16 characters per token the engine can hold
    (`prompt_chars_for`); `max_connections_per_client` 0: no per-client cap."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    body_min_rate: int = DEFAULT_BODY_MIN_RATE
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    probe_connections: int = DEFAULT_PROBE_CONNECTIONS
    grpc_max_streams_per_connection: int = DEFAULT_GRPC_STREAMS_PER_CONNECTION
    grpc_min_ping_interval_s: float = DEFAULT_GRPC_MIN_PING_INTERVAL_S
    grpc_max_connection_idle_s: float = DEFAULT_GRPC_MAX_CONNECTION_IDLE_S
    # image content parts (models with a vision tower: gpu_service.api.image_parts)
    max_images: int = 8
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 64 << 20
    allow_image_urls: bool = False
    image_fetch_timeout_s: float = 10.0

    def __post_init__(self):
        """Refuse impossible values, naming the flag."""
        for name in ("max_body_bytes", "body_min_rate", "max_connections", "grpc_max_streams_per_connection",
                     "max_images", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "grpc_min_ping_interval_s", "grpc_max_connection_idle_s"):
            if not getattr(self, name) > 0:
                flag = name[:-2].replace("_", "-")
                raise ValueError(f"--{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections_per_client < 0:
            raise ValueError(f"--max-connections-per-client must be >= 0 (0: no cap), "
                             f"got {self.max_connections_per_client}")
        if not 0 <= self.probe_connections < self.max_connections:
            raise ValueError(f"--probe-connections must be in [0, --max-connections ({self.max_connections})), "
                             f"got {self.probe_connections}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"--max-prompt-chars must be >= 1, got {self.max_prompt_chars}")

    def image_policy(self):
        """The gpu_service.api.image_parts.ImagePolicy of these limits."""
        from gpu_service.api.image_parts import ImagePolicy
        from gpu_service.model.image_inputs import ImageLimits

        return ImagePolicy(ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels),
                           self.allow_image_urls, self.image_fetch_timeout_s)

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
    """Pure ASGI middleware: API key on /v1 paths, body-size cap on every request (413 before a
    declared oversize body is read; a chunked one fails the app's read with `BodyTooLarge`)."""

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
