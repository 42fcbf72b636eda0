"""Bearer API keys to callers, re-read when the config file changes so new keys work without a restart.

A config file edited into something invalid while the node runs does not take the node down: the last good
keys stay in force, and one line is logged per bad version of the file.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cache.prefix_cache import ROUTED
from node.config import Caller, ConfigError, hash_key, load_config
from node.errors import InvalidRequest, PermissionDenied, Unauthenticated
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
        """The time to live of caller `name`'s state; a router's callers (`router/id`) have the router's."""
        caller = self._by_name.get(name.partition(ROUTED)[0])
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
        key = presented_key(authorization)
        self.refresh()
        digest = hash_key(key)
        for known, caller in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                return caller
        raise Unauthenticated("invalid API key")


def presented_key(authorization: str | None) -> str:
    """The API key of an `Authorization: Bearer <key>` header value; raises Unauthenticated otherwise."""
    if not authorization:
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
    if not key.isascii():  # keys are ASCII; a header with other bytes is no key (and never a 500)
        raise Unauthenticated("invalid API key")
    return key.strip()


ROUTER = "router"
CALLER_HEADER = "Tenzro-Caller"
"""With a router key: the id of the caller the router acts for."""
CALLER_ID = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def acting_for(router: Caller, caller_id: str) -> Caller:
    """The caller `router` asserts in `Tenzro-Caller`: named `router/id`, so that two routers' callers never share
    state, with the router's retention, time to live and requirements. Only a router key may assert one: any
    other key sending the header is refused, never served as itself."""
    if router.role != ROUTER:
        raise PermissionDenied(f"only a router key may send '{CALLER_HEADER}' ('tenzro keys add NAME --role "
                               f"router'); send the request without it", code="router_role_required")
    if not CALLER_ID.fullmatch(caller_id):
        raise InvalidRequest(f"'{CALLER_HEADER}' must be 1-64 letters, digits, '_', '.', '@' or '-'",
                             param=CALLER_HEADER, code="invalid_caller")
    return replace(router, name=router.name + ROUTED + caller_id, role="caller", router=router.name)


def require_role(caller: Caller | None, what: str, *roles: str) -> Caller:
    """`caller` if it has one of `roles`; raises Unauthenticated (no key) or PermissionDenied (code
    `<first role>_role_required`) otherwise."""
    needs = " or ".join(roles)
    needs = f"{'an' if needs[0] in 'aeiou' else 'a'} {needs}"
    if caller is None:
        raise Unauthenticated(f"{what} needs {needs} key: send the header 'Authorization: Bearer <key>'")
    if caller.role not in roles:
        raise PermissionDenied(f"{what} needs {needs} key, and this key's role is {caller.role} ('tenzro keys "
                               f"add NAME --role {roles[0]}' makes one)", code=f"{roles[0]}_role_required")
    return caller
