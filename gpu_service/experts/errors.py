"""The experts client's errors: a shard's failure (with its gRPC status), a wrong model, a coverage gap."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the status codes are grpc's; this module needs no grpc at run time (GPU-only hosts)
    import grpc

# grpc.StatusCode names of a shard that is down or silent (not a request at fault)
UNAVAILABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


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

    @property
    def unavailable(self) -> bool:
        """The shard (every replica of it) is down or silent, not the request at fault: HTTP 503."""
        return getattr(self.code, "name", None) in UNAVAILABLE_CODES


class FingerprintError(ExpertsClientError):
    """A shard serves a different model than the GPU service's config."""


class CoverageError(ExpertsClientError):
    """The shards do not cover every (layer, expert, intermediate slice) exactly once."""

    def __init__(self, message: str, missing: list, doubled: list):
        super().__init__(message)
        self.missing = missing  # [(layer, expert, i0, i1)]
        self.doubled = doubled  # [(layer, expert, i0, i1, [addresses])]
