"""Bearer API keys to callers, re-read when the config file changes so new keys work without a restart."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from node.config import Caller, hash_key, load_config
from node.errors import unauthorized


class KeyRing:
    def __init__(self, config_path: Path) -> None:
        self._path = config_path
        self._stamp: tuple[int, int] | None = None
        self._by_hash: dict[str, Caller] = {}
        self._refresh()

    def _refresh(self) -> None:
        try:
            stat = os.stat(self._path)
        except FileNotFoundError:
            self._by_hash, self._stamp = {}, None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._by_hash = {caller.key_sha256: caller for caller in load_config(self._path).callers}
            self._stamp = stamp

    def caller_for(self, authorization: str | None) -> Caller:
        """The caller of an `Authorization` header value; raises a 401 ApiError otherwise."""
        if not authorization:
            raise unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        self._refresh()
        digest = hash_key(key.strip())
        for known, caller in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                return caller
        raise unauthorized("invalid API key")
