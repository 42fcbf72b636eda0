"""Bearer API keys to callers, re-read when the config file changes so new keys work without a restart.

A config file edited into something invalid while the node runs does not take the node down: the last good
keys stay in force, and one line is logged per bad version of the file.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path

from node.config import Caller, ConfigError, hash_key, load_config
from node.errors import PermissionDenied, Unauthenticated
from node.log_privacy import Safe

log = logging.getLogger(__name__)


class KeyRing:
    def __init__(self, config_path: Path, on_removed: Callable[[str], None] | None = None) -> None:
        self._path = config_path
        self._stamp: tuple[int, int] | None = None
        self._by_hash: dict[str, Caller] = {}
        self._by_name: dict[str, Caller] = {}
        self._on_removed = on_removed
        """Called with the name of each caller that left the config: its state and keys are destroyed."""
        self.refresh()

    def ttl_of(self, name: str) -> float | None:
        caller = self._by_name.get(name)
        return None if caller is None else caller.ttl_s

    def refresh(self) -> None:
        """Re-read the config if it changed (the node calls this every `KEY_REFRESH_S`, and on each request)."""
        try:
            stat = os.stat(self._path)
        except FileNotFoundError:
            self._stamp = None
            self._use(())
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._stamp = stamp  # a bad version is reported once, not on every request
            try:
                callers = load_config(self._path).callers
            except (ConfigError, OSError, ValueError, TypeError, AttributeError) as exc:
                log.error("%s is invalid; the last good keys stay in force: %s", Safe(self._path), Safe(exc))
                return
            self._use(callers)

    def _use(self, callers: tuple[Caller, ...]) -> None:
        gone = set(self._by_name) - {caller.name for caller in callers}
        self._by_hash = {caller.key_sha256: caller for caller in callers}
        self._by_name = {caller.name: caller for caller in callers}
        if self._on_removed is not None:
            for name in sorted(gone):
                self._on_removed(name)

    def caller_for(self, authorization: str | None) -> Caller:
        """The caller of an `Authorization` header value; raises Unauthenticated otherwise."""
        if not authorization:
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        if not key.isascii():  # keys are ASCII; a header with other bytes is no key (and never a 500)
            raise Unauthenticated("invalid API key")
        self.refresh()
        digest = hash_key(key.strip())
        for known, caller in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                return caller
        raise Unauthenticated("invalid API key")


def require_operator(caller: Caller | None, what: str) -> Caller:
    """`caller` if its role is operator; raises Unauthenticated (no key) or PermissionDenied otherwise."""
    if caller is None:
        raise Unauthenticated(f"{what} needs an operator key: send the header 'Authorization: Bearer <key>'")
    if caller.role != "operator":
        raise PermissionDenied(f"{what} needs an operator key ('tenzro keys add NAME --role operator')")
    return caller
