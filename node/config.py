"""The node's configuration file: callers with hashed API keys and their requirements, cache budgets and limits.

YAML, parsed once into frozen dataclasses; unknown keys are errors. API keys are never stored: only the
SHA-256 of each key (keys are 256-bit random, so a plain digest is enough to make the file useless for
impersonation).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from cache.budget import CacheBudget
from policies.requirements import NO_REQUIREMENTS, CallerRequirements, RequirementsError, parse_requirements

KEY_PREFIX = "tz-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CALLER_ID = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
"""The id of a caller a router acts for (`Tenzro-Caller`); that caller is named `ROUTER/ID` on the node."""
GIB = 1024**3


class ConfigError(ValueError):
    """The configuration file is malformed; the message names the key to change."""


RETENTIONS = ("keep", "none")
"""keep: the caller's state is kept for reuse (sealed between requests); none: nothing is kept after a reply."""


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    key_sha256: str
    role: str = "caller"
    retention: str = "keep"
    ttl_s: int | None = None
    """Seconds the caller's stored state lives unused before it is destroyed; None: until evicted."""
    requirements: CallerRequirements = NO_REQUIREMENTS
    """What every request of this caller requires of the node; a request's headers can only narrow it."""
    router: str | None = None
    """The router acting for this caller (`node.auth.acting_for`): the caller is then named `router/id` and has
    the router's retention, time to live and requirements. Never in the file."""


@dataclass(frozen=True, slots=True)
class Group:
    """A trust group (`groups.NAME.members`): callers who may share prefixes (a system prompt, tool definitions)
    in the group's own scope (`cache.scope.group_scope`) when a request asks for it. A member is a caller of the
    file, or `ROUTER/ID`, a caller a router of the file acts for (whose router then sees the group's prefixes in
    its summaries, under the group's id). A caller is in one group at most, so that a request's group scope names
    one group."""

    name: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Limits:
    max_queue: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 256
    max_running: int = 32
    """Requests that run at once (each in its own lane of working memory; see node/engine/BATCHING.md)."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill chunk: a request arriving while a long prompt prefills waits at most about
    one chunk per prefilling request before its own prompt's chunks run. None: the device's
    (`node.engine.device.PREFILL_CHUNKS`: 256 on a CPU, 2048 on a GPU)."""
    lane_bytes: int | None = None
    """Working memory given to the `max_running` lanes at start, in all, per model (`ReuseManager.reserve_lanes`):
    written once then, so the first requests after a start do not fault fresh pages in on their time to first
    token. 0: lanes are allocated when first used. Lanes grow past it when a request needs more. None: the
    device's (`node.engine.device.LANE_BYTES`: 2 GiB on a CPU, 8 GiB on a GPU within a quarter of its free
    memory)."""
    max_messages: int = 4096
    """Messages in one chat request at most, checked before they are rendered. Twice the 2,048 that Azure
    OpenAI's chat API takes, which agents and their clients already live within; a conversation this long
    is hundreds of tool calls past where agents compact their history."""
    header_timeout_s: int = 10
    """Seconds a request's head (request line and headers) may take to arrive (`router.edge.HeadDeadline`): a
    head is a few hundred bytes, sent at once by any client; ten seconds still covers three lost and resent
    packets (TCP waits 1, 2, then 4 s), and a stalled head's connection is closed then instead of at the
    keep-alive timeout (75 s)."""
    body_timeout_s: int = 30
    """Seconds a request's body may take to arrive once its head has: the largest body (`max_body_bytes`, 8 MiB)
    needs about 2.2 Mbit/s to make it; a chat's body of tens of kilobytes makes it on any link. Raise it for
    callers who send large prompts over slower links."""


@dataclass(frozen=True, slots=True)
class NodeConfig:
    callers: tuple[Caller, ...] = ()
    cache: CacheBudget = field(default_factory=lambda: CacheBudget(node_bytes=4 * GIB, caller_bytes=1 * GIB))
    plaintext_bytes: int = 0
    """`cache.plaintext_bytes`: stored state kept unsealed (the hot tier) besides the last working cache, on a
    node whose state is in host memory (a CPU)."""
    device_bytes: int | None = None
    """`cache.device_bytes`: on a GPU, stored state kept unsealed in device memory (the hot tier there). None: a
    share of the device memory free once the model and lanes are loaded (`node.engine.device.DEVICE_SHARE`)."""
    reserve_bytes: int = 1 * GIB
    """`cache.reserve_bytes`: memory for sealed state, written at start (`cache/blob_memory.py`), so sealing a
    wave's new state does not populate fresh pages on the engine's thread. 0: sealed state takes memory of its
    own, as it needs it. Sealed state past it does so too."""
    default_ttl_s: int = 300
    """`cache.default_ttl_s`: how long stored state is held after its last use, for callers without a `ttl_s` of
    their own and requests that choose no time to live (`cache/ttl.py`)."""
    limits: Limits = field(default_factory=Limits)
    groups: tuple[Group, ...] = ()


ROLES = ("caller", "auditor", "operator", "router")
"""caller: completions and its own records; auditor: every record; operator: /metrics, GET /v1/node/state and the
queue in /health (neither auditors nor operators run completions);
router: completions as itself or for the callers it names in `Tenzro-Caller` (each one its own scope), the queue
in /health, and the summary of its callers' warm prefixes (`GET /v1/cache/summary`)."""


def tenzro_home() -> Path:
    return Path(os.environ.get("TENZRO_HOME", "~/.tenzro")).expanduser()


def default_config_path() -> Path:
    return tenzro_home() / "node.yaml"


def default_ledger_dir() -> Path:
    return tenzro_home() / "ledger"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _section(raw: Any, name: str, allowed: set[str], integers: bool = True) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"'{name}' must be a mapping")
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"unknown key(s) in '{name}': {', '.join(sorted(unknown))}; allowed: "
                          f"{', '.join(sorted(allowed))}")
    for key, value in raw.items():
        if integers and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"'{name}.{key}' must be a non-negative integer")
    return raw


CALLER_KEYS = {"key_sha256", "role", "retention", "ttl_s", "requirements"}


def _requirements(entry: dict[str, Any], name: str) -> CallerRequirements:
    if "requirements" not in entry:
        return NO_REQUIREMENTS
    try:
        return parse_requirements(entry["requirements"], f"callers.{name}.requirements")
    except RequirementsError as exc:
        raise ConfigError(str(exc)) from exc


def _groups(raw: Any, callers: list[Caller]) -> tuple[Group, ...]:
    """`groups.NAME.members`: each member a caller of the file or one its routers act for, in one group at most."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError("'groups' must be a mapping of group names to {members: [caller names]}")
    names = {caller.name for caller in callers}
    routers = {caller.name for caller in callers if caller.role == "router"}
    member_of: dict[str, str] = {}
    groups = []
    for name, entry in raw.items():
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ConfigError("a group name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
        members = entry.get("members") if isinstance(entry, dict) and set(entry) == {"members"} else None
        if not isinstance(members, list) or not all(isinstance(member, str) for member in members):
            raise ConfigError(f"groups.{name} must have only 'members': a list of caller names")
        for member in members:
            router, routed, caller_id = member.partition("/")
            if not (member in names or (routed and router in routers and CALLER_ID.fullmatch(caller_id))):
                raise ConfigError(f"groups.{name}.members: {member!r} is neither a caller of this file nor "
                                  f"ROUTER/ID for a router of this file")
            if member in member_of:
                raise ConfigError(f"groups.{name}.members: {member!r} is already a member of group "
                                  f"{member_of[member]!r}; a caller is in one group at most")
            member_of[member] = name
        groups.append(Group(name, tuple(members)))
    return tuple(groups)


def parse_config(raw: Any) -> NodeConfig:
    top = (_section(raw, "config", {"callers", "cache", "limits", "groups"}, integers=False)
           if raw is not None else {})
    callers = []
    for name, entry in (top.get("callers") or {}).items():
        if not isinstance(entry, dict) or set(entry) - CALLER_KEYS or "key_sha256" not in entry:
            raise ConfigError(f"callers.{name} must have 'key_sha256' and optionally 'role', 'retention', 'ttl_s', "
                              f"'requirements'")
        if entry.get("role", "caller") not in ROLES:
            raise ConfigError(f"callers.{name}.role must be one of {', '.join(ROLES)}")
        if entry.get("retention", "keep") not in RETENTIONS:
            raise ConfigError(f"callers.{name}.retention must be one of {', '.join(RETENTIONS)}")
        ttl = entry.get("ttl_s")
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0):
            raise ConfigError(f"callers.{name}.ttl_s must be a positive number of seconds")
        callers.append(Caller(str(name), str(entry["key_sha256"]), entry.get("role", "caller"),
                              entry.get("retention", "keep"), ttl, _requirements(entry, name)))
    defaults = NodeConfig()
    cache = _section(top.get("cache"), "cache", {"node_bytes", "caller_bytes", "plaintext_bytes", "reserve_bytes",
                                                  "default_ttl_s",
                                                  "device_bytes"})
    limits = _section(top.get("limits"), "limits", {"max_queue", "max_body_bytes", "default_max_tokens",
                                                    "max_running", "prefill_chunk", "lane_bytes",
                                                    "header_timeout_s", "body_timeout_s", "max_messages"})
    for key in ("max_running", "prefill_chunk", "header_timeout_s", "body_timeout_s", "max_messages"):
        if limits.get(key) == 0:
            raise ConfigError(f"'limits.{key}' must be at least 1")
    budget = CacheBudget(cache.get("node_bytes", defaults.cache.node_bytes),
                         cache.get("caller_bytes", defaults.cache.caller_bytes))
    return NodeConfig(callers=tuple(callers), cache=budget, plaintext_bytes=cache.get("plaintext_bytes", 0),
                      reserve_bytes=cache.get("reserve_bytes", defaults.reserve_bytes),
                      default_ttl_s=_default_ttl(cache.get("default_ttl_s", defaults.default_ttl_s)),
                      device_bytes=cache.get("device_bytes"), limits=replace(defaults.limits, **limits),
                      groups=_groups(top.get("groups"), callers))


def _default_ttl(seconds: int) -> int:
    if seconds <= 0:
        raise ConfigError("'cache.default_ttl_s' must be a positive number of seconds")
    return seconds


def load_config(path: Path) -> NodeConfig:
    if not path.exists():
        return NodeConfig()
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    return parse_config(raw)


def _dump_caller(caller: Caller) -> dict[str, Any]:
    entry: dict[str, Any] = {"key_sha256": caller.key_sha256, "role": caller.role}
    if caller.retention != "keep":
        entry["retention"] = caller.retention
    if caller.ttl_s is not None:
        entry["ttl_s"] = caller.ttl_s
    if caller.requirements != NO_REQUIREMENTS:
        entry["requirements"] = caller.requirements.as_config()
    return entry


def _dump(config: NodeConfig) -> dict[str, Any]:
    """The file's mapping; a key left to the device (None) is left out, as it is read back."""
    cache = {"node_bytes": config.cache.node_bytes, "caller_bytes": config.cache.caller_bytes,
             "plaintext_bytes": config.plaintext_bytes, "reserve_bytes": config.reserve_bytes,
             "default_ttl_s": config.default_ttl_s,
             "device_bytes": config.device_bytes}
    limits = {"max_queue": config.limits.max_queue, "max_body_bytes": config.limits.max_body_bytes,
              "default_max_tokens": config.limits.default_max_tokens, "max_running": config.limits.max_running,
              "prefill_chunk": config.limits.prefill_chunk, "lane_bytes": config.limits.lane_bytes,
              "header_timeout_s": config.limits.header_timeout_s, "body_timeout_s": config.limits.body_timeout_s,
              "max_messages": config.limits.max_messages}
    return {
        "callers": {c.name: _dump_caller(c) for c in config.callers},
        "cache": {key: value for key, value in cache.items() if value is not None},
        "limits": {key: value for key, value in limits.items() if value is not None},
        **({"groups": {group.name: {"members": list(group.members)} for group in config.groups}}
           if config.groups else {}),
    }


def save_config(path: Path, config: NodeConfig) -> None:
    """Atomic write, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".node-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(_dump(config), handle, sort_keys=False)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def remove_key(path: Path, name: str) -> None:
    """Remove caller `name` (and its group memberships); a running node then destroys the caller's stored state and
    its key."""
    config = load_config(path)
    if not any(c.name == name for c in config.callers):
        raise ConfigError(f"no caller named {name!r} in {path}")
    groups = tuple(replace(group, members=tuple(member for member in group.members
                                                if member != name and not member.startswith(name + "/")))
                   for group in config.groups)
    save_config(path, replace(config, callers=tuple(c for c in config.callers if c.name != name), groups=groups))


def add_key(path: Path, name: str, role: str = "caller", retention: str | None = None,
            ttl_s: int | None = None) -> str:
    """Create caller `name` (or give it a new key, keeping its retention unless given, and its requirements) and
    return the key; only its hash is stored."""
    if not NAME_PATTERN.match(name):
        raise ConfigError("a caller name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}")
    if retention is not None and retention not in RETENTIONS:
        raise ConfigError(f"retention must be one of {', '.join(RETENTIONS)}")
    if ttl_s is not None and ttl_s <= 0:
        raise ConfigError("ttl_s must be a positive number of seconds")
    config = load_config(path)
    old = next((c for c in config.callers if c.name == name), None)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    caller = Caller(name, hash_key(key), role, retention or (old.retention if old else "keep"),
                    ttl_s if ttl_s is not None else (old.ttl_s if old else None),
                    old.requirements if old else NO_REQUIREMENTS)
    callers = tuple(c for c in config.callers if c.name != name) + (caller,)
    save_config(path, replace(config, callers=callers))
    return key
