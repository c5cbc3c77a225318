"""Who may call a shard: a shared token on every gRPC call (and so on the data paths it attaches).

Besides mutual TLS (wire.channel), a shard can require a shared secret: started with
`--auth-token-file F` (or MOESPLIT_SHARD_TOKEN / MOESPLIT_SHARD_TOKEN_FILE in its environment), it
refuses every ExpertService call whose `x-moesplit-shard-token` metadata is not that token with
UNAUTHENTICATED (compared in constant time; refusals logged one line per peer per interval).
The GPU side sends the token from the same environment variables (wire.channel.make_channel).
`grpc.health.v1` stays open: it reveals nothing, and Kubernetes' gRPC probes send no metadata.

The data paths are covered through gRPC: the TCP data port admits only a connection presenting a
one-time token handed out by `AttachTcp`, and shared memory is attached with `AttachShm` (whose
peer uid is checked besides), both refused without the shared token.
"""
from __future__ import annotations

import hmac
import logging

import grpc

from wire.channel import shard_token, TOKEN_METADATA
from wire.ratelog import RateLimitedLog

log = logging.getLogger("moesplit.expert_server")
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def resolve_token(token_file: str | None) -> bytes | None:
    """The shard's token: from `--auth-token-file`, else the environment (None: no token required).
    ValueError naming the fix for an unreadable or empty file."""
    if token_file is None:
        return shard_token()
    try:
        with open(token_file, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"--auth-token-file {token_file}: cannot read ({e.strerror})") from None
    if not token:
        raise ValueError(f"--auth-token-file {token_file} is empty; write the shared token into it")
    return token


def add_arguments(p) -> None:
    p.add_argument("--auth-token-file", default=None,
                   help="require this file's shared token (x-moesplit-shard-token metadata) on every call; "
                        "default: $MOESPLIT_SHARD_TOKEN or $MOESPLIT_SHARD_TOKEN_FILE, else no token")


class TokenAuth(grpc.ServerInterceptor):
    """Refuses ExpertService calls without the shared token with UNAUTHENTICATED."""

    def __init__(self, token: bytes):
        if not token:
            raise ValueError("TokenAuth needs a non-empty token")
        self.token = token
        self.refused = 0
        self._log = RateLimitedLog(log)

    def _allowed(self, details) -> bool:
        got = next((v for k, v in (details.invocation_metadata or ()) if k == TOKEN_METADATA), None)
        if got is None:
            return False
        got = got.encode() if isinstance(got, str) else bytes(got)
        return hmac.compare_digest(got, self.token)

    def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_SERVICES) or self._allowed(details):
            return continuation(details)
        self.refused += 1
        handler = continuation(details)
        if handler is None:
            return None
        why = ("this shard requires its shared token: start the GPU service with MOESPLIT_SHARD_TOKEN "
               "(or MOESPLIT_SHARD_TOKEN_FILE) set to the shard's --auth-token-file contents")
        method = details.method

        def refuse(request, context):
            self._log.warning(("auth", context.peer().rsplit(":", 1)[0]), "refused %s from %s: no valid shard token", method,
                              context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
            (handler.request_streaming, handler.response_streaming)]
        return kind(refuse, request_deserializer=None, response_serializer=None)
