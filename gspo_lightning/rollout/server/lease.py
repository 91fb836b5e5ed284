"""Who holds a rollout server: one trainer at a time (its ranks share one token), until it lets
go or stays idle for ``lease_s`` (a crashed trainer frees the server)."""

from __future__ import annotations

import threading
import time
from typing import Optional


class SessionError(RuntimeError):
    """The server is held by another trainer."""


class SessionLease:
    """The token of the trainer holding the server, and when it was last heard from.

    Args:
        lease_s: a holder idle this long loses its hold.
    """

    def __init__(self, lease_s: float = 120.0):
        self.lease_s = lease_s
        self._token: Optional[str] = None
        self._last_seen = 0.0
        self._lock = threading.Lock()

    def hold(self, token: Optional[str]) -> None:
        """Take or renew the hold for ``token``; refused while another trainer holds the server."""
        if not token:
            raise SessionError("no session token: open a session with POST /session first")
        with self._lock:
            now = time.monotonic()
            if self._token not in (None, token) and now - self._last_seen < self.lease_s:
                raise SessionError(f"this rollout server is in use by another trainer (idle {now - self._last_seen:.0f} s; "
                                   f"it frees after {self.lease_s:.0f} s idle): start another server for this run")
            self._token, self._last_seen = token, now

    def release(self, token: Optional[str]) -> None:
        with self._lock:
            if self._token == token:
                self._token = None

    def held(self) -> bool:
        """Whether a trainer holds the server now (a lapsed lease does not count)."""
        with self._lock:
            return self._token is not None and time.monotonic() - self._last_seen < self.lease_s


__all__ = ["SessionError", "SessionLease"]
