"""Bearer API keys to callers, re-read when the config file changes so new keys work without a restart.

A config file edited into something invalid while the node runs does not take the node down: the last good
keys stay in force, and one line is logged per bad version of the file.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cache.prefix_cache import ROUTED
from cache.scope import GROUP
from node.config import CALLER_ID, Caller, ConfigError, Group, NodeConfig, hash_key, load_config
from node.errors import InvalidRequest, PermissionDenied, Unauthenticated
from node.log_privacy import Safe

log = logging.getLogger(__name__)


class KeyRing:
    def __init__(self, config_path: Path, on_removed: Callable[[str], None] | None = None) -> None:
        self._path = config_path
        self._stamp: tuple[int, int] | None = None
        self._by_hash: dict[str, Caller] = {}
        self._by_name: dict[str, Caller] = {}
        self._group_of: dict[str, str] = {}
        """Each member's trust group, as the config says now."""
        self._groups: frozenset[str] = frozenset()
        self._default_ttl_s: float = NodeConfig().default_ttl_s
        self._on_removed = on_removed
        """Called with the name of each caller that left the config, and with `group:NAME` for each trust group
        that did: its state and keys are destroyed."""
        self.refresh()

    def ttl_of(self, name: str) -> float | None:
        """The default time to live of caller `name`'s state: its `ttl_s`, else the node's `cache.default_ttl_s`; a
        router's callers (`router/id`) have the router's, a trust group's scope (`group:NAME`) the node's. None (no
        limit) for a name that is no caller or group."""
        caller = self._by_name.get(name.partition(ROUTED)[0])
        if caller is None:
            in_group = name.startswith(GROUP) and name.removeprefix(GROUP) in self._groups
            return self._default_ttl_s if in_group else None
        return self._default_ttl_s if caller.ttl_s is None else caller.ttl_s

    def group_of(self, name: str) -> str | None:
        """The trust group caller `name` is a member of now (checked on every request: a member removed from its
        group reads nothing of it from then on); None for a non-member."""
        self.refresh()
        return self._group_of.get(name)

    def groups_routed_by(self, router: str) -> frozenset[str]:
        """The trust groups with a member that `router` acts for (`ROUTER/ID`): their prefixes are in its
        summaries."""
        return frozenset(group for member, group in self._group_of.items() if member.startswith(router + ROUTED))

    def refresh(self) -> None:
        """Re-read the config if it changed (the node calls this every `KEY_REFRESH_S`, and on each request)."""
        try:
            stat = os.stat(self._path)
        except FileNotFoundError:
            self._stamp = None
            self._use((), ())
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._stamp = stamp  # a bad version is reported once, not on every request
            try:
                config = load_config(self._path)
            except (ConfigError, OSError, ValueError, TypeError, AttributeError) as exc:
                log.error("%s is invalid; the last good keys stay in force: %s", Safe(self._path), Safe(exc))
                return
            self._default_ttl_s = config.default_ttl_s
            self._use(config.callers, config.groups)

    def _use(self, callers: tuple[Caller, ...], groups: tuple[Group, ...]) -> None:
        gone = set(self._by_name) - {caller.name for caller in callers}
        gone |= {GROUP + name for name in self._groups - {group.name for group in groups}}
        self._by_hash = {caller.key_sha256: caller for caller in callers}
        self._by_name = {caller.name: caller for caller in callers}
        self._group_of = {member: group.name for group in groups for member in group.members}
        self._groups = frozenset(group.name for group in groups)
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
