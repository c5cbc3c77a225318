"""Rate-limited logging for errors a client can cause: one line per cause per interval, no traceback.

A client that sends the same bad call in a loop must not turn each one into a log line (or a
traceback): `RateLimitedLog.warning(key, fmt, *args)` logs the first occurrence of `key` in each
`interval_s` window and counts the rest; the next logged line says how many were suppressed.

    client_errors = RateLimitedLog(logging.getLogger("moesplit.tcp"))
    client_errors.warning(("hello", peer_host), "tcp data path: %s presented no valid token", peer_host)

No torch here (the shard imports it).
"""
from __future__ import annotations

import logging
import threading
import time

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 1024  # distinct causes remembered (the oldest forgotten beyond: memory stays bounded)


class RateLimitedLog:
    """At most one line per key per `interval_s`; suppressed lines are counted and reported."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S):
        self.logger, self.interval_s = logger, interval_s
        self._last: dict = {}  # key -> [time logged (monotonic), suppressed since]
        self._lock = threading.Lock()
        self.suppressed = 0

    def _should_log(self, key) -> int | None:
        """None to suppress, else the count suppressed since the key was last logged."""
        now = time.monotonic()
        with self._lock:
            got = self._last.get(key)
            if got is not None and now - got[0] < self.interval_s:
                got[1] += 1
                self.suppressed += 1
                return None
            if got is None and len(self._last) >= MAX_KEYS:
                self._last.pop(next(iter(self._last)))
            self._last[key] = [now, 0]
            return 0 if got is None else got[1]

    def log(self, level: int, key, fmt: str, *args) -> bool:
        """Log `fmt % args` at `level` unless `key` was logged within the interval; True if logged."""
        n = self._should_log(key)
        if n is None:
            return False
        if n:
            fmt, args = fmt + " (%d more like it suppressed)", args + (n,)
        self.logger.log(level, fmt, *args)
        return True

    def warning(self, key, fmt: str, *args) -> bool:
        return self.log(logging.WARNING, key, fmt, *args)

    def info(self, key, fmt: str, *args) -> bool:
        return self.log(logging.INFO, key, fmt, *args)
