"""gRPC transport settings shared by the expert shard server and the GPU side's experts client.

- Message sizes come from the model: the largest layer call is `max_tokens` rows of a float32
  hidden state plus its top-k ids (int64) and weights (float32); the limit is that plus headroom,
  not gRPC's 4 MiB default and not "unlimited".
- Keepalive pings keep the long-lived Forward streams honest: a peer that vanishes without a TCP
  reset (a node lost, a partition) is noticed within keepalive_time + keepalive_timeout. The
  server accepts pings as often as the client sends them (no GOAWAY "too_many_pings").
- Mutual TLS: `server_credentials` requires a client certificate signed by the CA;
  `channel_credentials` presents the client's own. Files are PEM (the Helm chart mounts
  tls.crt / tls.key / ca.crt from one Secret).
- Shared token: with MOESPLIT_SHARD_TOKEN (or MOESPLIT_SHARD_TOKEN_FILE, a file holding it) set,
  `make_channel` sends it as `x-moesplit-shard-token` metadata on every call; a shard started
  with the same token refuses calls without it (cpu_expert_service.auth).

No torch here (the shard imports it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from checkpoint.config import ModelConfig

# initial metadata of a shard's Forward / ForwardOne answers: its process's ShardInfo.instance_id (a restart
# at the same address shows another one: the GPU side re-describes and re-checks it before using answers)
INSTANCE_KEY = "x-moesplit-instance"
DEFAULT_MAX_TOKENS = 16384  # largest T per layer call (shard --max-tokens default)
HEADROOM_BYTES = 4 << 20  # protobuf framing, dtype strings, shapes, metadata
GRPC_MAX_MESSAGE = 2**31 - 1

CLIENT_KEEPALIVE_MS = 10_000  # ping an idle connection every 10 s ...
KEEPALIVE_TIMEOUT_MS = 5_000  # ... and drop it when the ack is 5 s late
SERVER_KEEPALIVE_MS = 30_000
MIN_PING_INTERVAL_MS = 5_000  # the server tolerates client pings this often (< CLIENT_KEEPALIVE_MS)
RECONNECT_INITIAL_MS = 200  # the channel's own reconnect backoff (gRPC default: 1 s .. 120 s)
RECONNECT_MAX_MS = 5_000
TOKEN_ENV = "MOESPLIT_SHARD_TOKEN"
TOKEN_FILE_ENV = "MOESPLIT_SHARD_TOKEN_FILE"
TOKEN_METADATA = "x-moesplit-shard-token"


def max_message_bytes(cfg: ModelConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """Largest LayerRequest / LayerResponse for `max_tokens` rows of this model, plus headroom."""
    per_token = cfg.hidden_size * 4 + cfg.num_experts_per_tok * (8 + 4)  # f32 hidden + int64 ids + f32 w
    return min(GRPC_MAX_MESSAGE, int(max_tokens * per_token * 1.05) + HEADROOM_BYTES)


def server_options(cfg: ModelConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[tuple[str, int]]:
    n = max_message_bytes(cfg, max_tokens)
    return [
        ("grpc.max_receive_message_length", n),
        ("grpc.max_send_message_length", n),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
        ("grpc.so_reuseport", 0),  # a second shard on the same port fails to bind instead of sharing it
    ]


def channel_options(cfg: ModelConfig, max_tokens: int = DEFAULT_MAX_TOKENS,
                    server_name: str | None = None) -> list[tuple[str, object]]:
    n = max_message_bytes(cfg, max_tokens)
    opts: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", n),
        ("grpc.max_send_message_length", n),
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
        ("grpc.enable_retries", 0),  # the experts client retries on another replica itself
    ]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return opts


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths: this side's certificate and key, and the CA that signs the other side's."""

    cert: str
    key: str
    ca: str

    @staticmethod
    def from_args(cert: str | None, key: str | None, ca: str | None, what: str) -> "TLSFiles | None":
        """None when no flag is given; ValueError naming the missing flags when only some are."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise ValueError(f"{what}: mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
        return TLSFiles(cert, key, ca)

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise ValueError(f"{flag} {path}: cannot read ({e.strerror})") from None
        return out[0], out[1], out[2]


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server side of mutual TLS: a client certificate signed by `tls.ca` is required."""
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    """Client side of mutual TLS: verify the server against `tls.ca`, present our certificate."""
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def shard_token() -> bytes | None:
    """The shared shard token from MOESPLIT_SHARD_TOKEN or the file MOESPLIT_SHARD_TOKEN_FILE names
    (None when neither is set); ValueError naming the fix when both are, or the file is unusable."""
    raw, path = os.environ.get(TOKEN_ENV), os.environ.get(TOKEN_FILE_ENV)
    if raw and path:
        raise ValueError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if path:
        try:
            with open(path, "rb") as f:
                raw = f.read().decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{TOKEN_FILE_ENV}={path}: cannot read an ASCII token ({e})") from None
        if not raw:
            raise ValueError(f"{TOKEN_FILE_ENV}={path} is empty; write the shared token into it")
    if raw and not (raw.isascii() and raw.isprintable()):
        raise ValueError(f"{TOKEN_ENV}: the token must be printable ASCII (gRPC metadata), e.g. 32 hex digits")
    return raw.encode() if raw else None


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the shard token to every call's metadata."""

    def __init__(self, token: bytes):
        self.pair = (TOKEN_METADATA, token.decode("ascii"))

    def _details(self, d):
        md = list(d.metadata or ()) + [self.pair]
        return _CallDetails(d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


def host_of(address: str) -> str:
    """The host part of a 'host:port' address ('10.0.0.5:50051' -> '10.0.0.5', '[::1]:5' -> '::1')."""
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


def make_channel(address: str, options, tls: TLSFiles | None = None,
                 creds: grpc.ChannelCredentials | None = None, token: bytes | None = None) -> grpc.Channel:
    """A channel to a shard: mutual TLS with `tls` / `creds`, the shared token (`token`, else
    shard_token() from the environment) on every call when there is one."""
    if tls is None and creds is None:
        ch = grpc.insecure_channel(address, options=options)
    else:
        ch = grpc.secure_channel(address, creds or channel_credentials(tls), options=options)
    token = token or shard_token()
    return grpc.intercept_channel(ch, _TokenMetadata(token)) if token else ch


def add_tls_arguments(p, side: str) -> None:
    """--tls-cert/--tls-key/--tls-ca (the Helm chart's names) on either side."""
    if side == "server":
        p.add_argument("--tls-cert", help="PEM certificate of this shard (enables mutual TLS; needs --tls-key, --tls-ca)")
        p.add_argument("--tls-key", help="PEM private key of --tls-cert")
        p.add_argument("--tls-ca", help="PEM CA that signs the GPU service's client certificate (required of clients)")
    else:
        p.add_argument("--tls-cert", help="PEM client certificate presented to the expert shards (mutual TLS)")
        p.add_argument("--tls-key", help="PEM private key of --tls-cert")
        p.add_argument("--tls-ca", help="PEM CA that signs the expert shards' certificates")
        p.add_argument("--tls-server-name", default=None,
                       help="expected name in the shards' certificates when it differs from the address host")
