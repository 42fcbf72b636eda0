"""The providers file: the nodes a router sends to (with the router's key at each), its own callers, and timings.

YAML, parsed once at start into frozen dataclasses; unknown keys are errors, and every error names the key to
change. A provider's declared jurisdiction, trust tier and evidence type stand only until its `GET /v1/node`
says otherwise: the node's own answer replaces each of them as soon as it carries it, and a node enforces the
requirements the router forwards with its real offer in any case, so a wrong declaration costs a refusal and a
retry elsewhere, never a request served outside its requirements.

    settings:                          # optional; the defaults below
      poll_interval_s: 2               # /health, /v1/node and summaries of every provider, this often
      connect_timeout_s: 5             # also the whole of each poll request
      first_byte_timeout_s: 300        # a provider silent this long before its first byte is tried elsewhere
      max_body_bytes: 8388608
      header_timeout_s: 10             # a client's request head, and then its body, must arrive within these
      body_timeout_s: 30               #   (the node's limits.header_timeout_s and body_timeout_s, for its reasons)
    providers:
      - name: node-a
        url: https://node-a.example:8080
        api_key_env: TENZRO_NODE_A_KEY # or api_key: tz-... (the router's key at that node, role router)
        models: [default]
        jurisdiction: DE               # optional declarations, until GET /v1/node says otherwise
        trust_tier: confidential
        evidence: sev-snp
    trust:                             # optional: verify every provider before sending it anything
      policy: trust.yaml               # a trust policy (attestation/trust_policy.py), relative to this file
      allow_none: false                # accept providers without a TEE (development only)
    callers:
      alice:
        key_sha256: 64 hex characters  # printf %s "$KEY" | sha256sum
        min_trust_tier: confidential   # optional
        requirements: {jurisdictions: [DE, FR], max_price_wei: {input: 2000000000}}   # optional, as node.yaml
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from attestation.trust_policy import TrustPolicy, TrustPolicyError
from policies.jurisdiction import code_problem
from policies.node_policy import TRUST_TIERS
from policies.requirements import NO_TEE
from router.callers import RouterCaller, parse_callers
from router.errors import RouterConfigError

EVIDENCE_TYPES = (NO_TEE, "sev-snp", "tdx")
PROVIDER_KEYS = ("name", "url", "api_key", "api_key_env", "models", "jurisdiction", "trust_tier", "evidence")
TOP_KEYS = ("settings", "providers", "callers", "trust")
TRUST_KEYS = ("policy", "allow_none")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True, slots=True)
class Declared:
    """What the operator declares of a node, until the node's `GET /v1/node` says otherwise."""

    jurisdiction: str | None = None
    trust_tier: str = TRUST_TIERS[0]
    evidence_type: str = NO_TEE
    """A declared TEE counts as verified: the operator vouches for it (and the node enforces the real one)."""


@dataclass(frozen=True, slots=True)
class ProviderSpec:
    name: str
    url: str
    """Base URL without a trailing slash; the node's routes (`/v1/...`, `/health`) are appended to it."""
    api_key: str = field(repr=False)
    """The router's key at this node: never printed, never sent anywhere but this node."""
    models: tuple[str, ...]
    declared: Declared = Declared()


@dataclass(frozen=True, slots=True)
class RouterSettings:
    poll_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 300.0
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 10.0
    """How long a client's request head may take to arrive (`router.edge.HeadDeadline`); the reasons for this
    value and the next are the node's (`node/config.py` `Limits`)."""
    body_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class RouterTrust:
    """The router's own verification of its providers (`trust:` in the providers file): each provider's evidence
    verified under this trust policy before anything is sent to it, and every request over a connection pinned to the
    certificate that evidence binds (`router.registry`)."""

    policy: TrustPolicy
    allow_none: bool


@dataclass(frozen=True, slots=True)
class RouterConfig:
    providers: tuple[ProviderSpec, ...]
    callers: tuple[RouterCaller, ...]
    settings: RouterSettings = RouterSettings()
    trust: RouterTrust | None = None
    """None: no verification of the providers (their own `trusted` word and declarations stand), plain or
    CA-verified connections."""


def _mapping(raw: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RouterConfigError(f"{where} must be a mapping")
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        raise RouterConfigError(f"unknown key(s) in {where}: {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return raw


def _settings(raw: Any) -> RouterSettings:
    defaults = RouterSettings()
    allowed = tuple(item.name for item in fields(RouterSettings))
    entry = _mapping(raw, "settings", allowed)
    for key, value in entry.items():
        integer = key == "max_body_bytes"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value <= 0:
            raise RouterConfigError(f"settings.{key} must be a positive {'whole number' if integer else 'number'}, "
                                    f"got {value!r}")
    return RouterSettings(**{key: entry.get(key, getattr(defaults, key)) for key in allowed})


def _url(value: Any, where: str) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise RouterConfigError(f"{where}.url must be an http(s) base URL such as https://node.example:8080, got "
                                f"{value!r}")
    return value.rstrip("/")


def _api_key(entry: dict[str, Any], where: str, environ: Mapping[str, str]) -> str:
    if ("api_key" in entry) == ("api_key_env" in entry):
        raise RouterConfigError(f"{where} needs exactly one of api_key (the router's key at the node) or "
                                f"api_key_env (the environment variable holding it)")
    if "api_key_env" in entry:
        name = entry["api_key_env"]
        if not isinstance(name, str) or not environ.get(name):
            raise RouterConfigError(f"{where}.api_key_env names {name!r}, which is not set in the environment")
        key = environ[name]
    else:
        key = entry["api_key"]
    if not isinstance(key, str) or not key.isascii() or not key.strip() or key != key.strip():
        raise RouterConfigError(f"{where}'s API key must be a non-empty ASCII string without surrounding spaces")
    return key


def _declared(entry: dict[str, Any], where: str) -> Declared:
    jurisdiction = entry.get("jurisdiction")
    if jurisdiction is not None:
        problem = code_problem(jurisdiction)
        if problem is not None:
            raise RouterConfigError(f"{where}.jurisdiction {problem}")
    tier = entry.get("trust_tier", TRUST_TIERS[0])
    if tier not in TRUST_TIERS:
        raise RouterConfigError(f"{where}.trust_tier must be one of {', '.join(TRUST_TIERS)}, got {tier!r}")
    evidence = entry.get("evidence", NO_TEE)
    if evidence not in EVIDENCE_TYPES:
        raise RouterConfigError(f"{where}.evidence must be one of {', '.join(EVIDENCE_TYPES)}, got {evidence!r}")
    return Declared(jurisdiction, tier, evidence)


def _provider(raw: Any, index: int, environ: Mapping[str, str]) -> ProviderSpec:
    where = f"providers[{index}]"
    entry = _mapping(raw, where, PROVIDER_KEYS)
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RouterConfigError(f"{where}.name must be 1-64 letters, digits, '_', '.' or '-', starting with a letter "
                                f"or digit (it is sent to callers as Tenzro-Provider), got {name!r}")
    where = f"providers[{index}] ({name})"
    models = entry.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise RouterConfigError(f"{where}.models must be a non-empty list of the model ids it serves")
    return ProviderSpec(name, _url(entry.get("url"), where), _api_key(entry, where, environ), tuple(models),
                        _declared(entry, where))


def _trust(raw: Any, base: Path) -> RouterTrust:
    entry = _mapping(raw, "trust", TRUST_KEYS)
    if not isinstance(entry.get("policy"), str) or not isinstance(entry.get("allow_none", False), bool):
        raise RouterConfigError("trust.policy must name a trust policy file (relative to the providers file), and "
                                "trust.allow_none be true or false")
    try:
        policy = TrustPolicy.load(base / entry["policy"])
    except TrustPolicyError as exc:
        raise RouterConfigError(f"trust.policy: {exc}") from exc
    return RouterTrust(policy, entry.get("allow_none", False))


def parse_router_config(raw: Any, environ: Mapping[str, str], base: Path | None = None) -> RouterConfig:
    """A router's configuration from parsed YAML; `environ` resolves `api_key_env`, `base` (the providers file's
    directory) a relative trust policy path."""
    top = _mapping(raw, "the providers file", TOP_KEYS)
    listed = top.get("providers")
    if not isinstance(listed, list) or not listed:
        raise RouterConfigError("'providers' must be a non-empty list of nodes")
    providers = tuple(_provider(entry, index, environ) for index, entry in enumerate(listed))
    names = [provider.name for provider in providers]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RouterConfigError(f"provider name(s) {', '.join(duplicates)} appear more than once: names must be "
                                f"unique")
    settings = _settings(top["settings"]) if top.get("settings") is not None else RouterSettings()
    trust = _trust(top["trust"], base or Path.cwd()) if top.get("trust") is not None else None
    return RouterConfig(providers, parse_callers(top.get("callers")), settings, trust)


def load_router_config(path: Path, environ: Mapping[str, str] | None = None) -> RouterConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RouterConfigError(f"cannot read the providers file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise RouterConfigError(f"{path} is not valid YAML: {exc}") from exc
    return parse_router_config(raw, os.environ if environ is None else environ, path.parent)
