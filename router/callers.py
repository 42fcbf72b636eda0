"""The router's own callers: their API keys (stored as SHA-256, as a node stores its keys), what each caller's
requests require, and the caller id the router asserts to nodes in `Tenzro-Caller`.

A node sees the router as one caller (the router's key there) acting for many (the `Tenzro-Caller` id), and keeps
state per (router, caller) scope: the caller's name here is that id, so it is checked against the header's form
when the file is read, not when a request is already on its way.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from policies.node_policy import TRUST_TIERS
from policies.requirements import NO_REQUIREMENTS, CallerRequirements, RequirementsError, parse_requirements
from router.errors import RouterConfigError, Unauthenticated

CALLER_ID = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
"""The form of a `Tenzro-Caller` id, which a node refuses otherwise."""
KEY_SHA256 = re.compile(r"[0-9a-f]{64}")
CALLER_KEYS = ("key_sha256", "requirements", "min_trust_tier")


def hash_key(key: str) -> str:
    """What the file stores for a key. Keys are 256-bit random, so a plain digest makes the file useless for
    impersonation (node/config.py's rule; the router may not import the node)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RouterCaller:
    name: str
    """The caller's id: sent to nodes as `Tenzro-Caller`, and part of every summary key for this caller."""
    key_sha256: str
    requirements: CallerRequirements = NO_REQUIREMENTS
    """What every request of this caller requires; its requirement headers can only narrow it."""
    min_trust_tier: str = TRUST_TIERS[0]
    """The lowest node trust tier (TRUST_TIERS, weakest first) this caller's requests may go to."""


def _caller(name: object, entry: Any) -> RouterCaller:
    where = f"callers.{name}"
    if not isinstance(name, str) or not CALLER_ID.fullmatch(name):
        raise RouterConfigError(f"caller name {name!r} must be 1-64 letters, digits, '_', '.', '@' or '-' (it is "
                                f"sent to nodes as Tenzro-Caller)")
    if not isinstance(entry, dict):
        raise RouterConfigError(f"{where} must be a mapping with 'key_sha256'")
    unknown = sorted(str(key) for key in entry if key not in CALLER_KEYS)
    if unknown:
        raise RouterConfigError(f"unknown key(s) in {where}: {', '.join(unknown)}; allowed: {', '.join(CALLER_KEYS)}")
    digest = entry.get("key_sha256")
    if not isinstance(digest, str) or not KEY_SHA256.fullmatch(digest):
        raise RouterConfigError(f"{where}.key_sha256 must be the SHA-256 of the caller's key as 64 lower-case hex "
                                f"characters (printf %s \"$KEY\" | sha256sum)")
    tier = entry.get("min_trust_tier", TRUST_TIERS[0])
    if tier not in TRUST_TIERS:
        raise RouterConfigError(f"{where}.min_trust_tier must be one of {', '.join(TRUST_TIERS)}, got {tier!r}")
    requirements = NO_REQUIREMENTS
    if "requirements" in entry:
        try:
            requirements = parse_requirements(entry["requirements"], f"{where}.requirements")
        except RequirementsError as exc:
            raise RouterConfigError(str(exc)) from exc
    return RouterCaller(name, digest, requirements, tier)


def parse_callers(raw: Any) -> tuple[RouterCaller, ...]:
    """The `callers` section: a mapping from caller name to `key_sha256` and optional `requirements` (as in
    node.yaml) and `min_trust_tier`."""
    if not isinstance(raw, dict) or not raw:
        raise RouterConfigError("'callers' must be a mapping naming at least one caller, e.g. "
                                "callers: {alice: {key_sha256: ...}}")
    callers = tuple(_caller(name, entry) for name, entry in raw.items())
    digests = [caller.key_sha256 for caller in callers]
    if len(set(digests)) != len(digests):
        raise RouterConfigError("two callers share a key_sha256: give each caller its own key")
    return callers


class CallerKeys:
    """Bearer API keys to the router's callers."""

    def __init__(self, callers: Iterable[RouterCaller]) -> None:
        self._callers = tuple(callers)

    def caller_for(self, authorization: str | None) -> RouterCaller:
        """The caller of an `Authorization` header value; raises Unauthenticated otherwise."""
        if not authorization:
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        if not key.isascii():
            raise Unauthenticated("invalid API key")
        digest = hash_key(key.strip())
        found = None
        for caller in self._callers:  # every digest compared, so the time taken does not say which came close
            if hmac.compare_digest(caller.key_sha256, digest):
                found = caller
        if found is None:
            raise Unauthenticated("invalid API key")
        return found
