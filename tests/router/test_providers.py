"""The providers file (router/providers.py) and the router's callers in it (router/callers.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.requirements import CallerRequirements
from router.callers import CallerKeys, RouterCaller, hash_key
from router.errors import RouterConfigError, Unauthenticated
from router.providers import (
    Declared,
    ProviderSpec,
    RouterConfig,
    RouterSettings,
    load_router_config,
    parse_router_config,
)

ALICE_SHA = hash_key("tz-alice")
EXAMPLE = f"""
settings:
  poll_interval_s: 1
  first_byte_timeout_s: 30.5
providers:
  - name: node-a
    url: https://node-a.example:8080/
    api_key_env: NODE_A_KEY
    models: [default, big]
    jurisdiction: DE
    trust_tier: confidential
    evidence: sev-snp
  - name: node-b
    url: http://10.0.0.2:8080
    api_key: tz-router-at-b
    models: [default]
callers:
  alice:
    key_sha256: {ALICE_SHA}
    min_trust_tier: confidential
    requirements: {{jurisdictions: [DE, FR], max_price_wei: {{input: 2000000000}}}}
  svc.batch@team-1:
    key_sha256: {hash_key("tz-batch")}
"""
ENVIRON = {"NODE_A_KEY": "tz-router-at-a"}


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE)


def test_a_providers_file_parses_into_exact_values() -> None:
    config = parse_router_config(example(), ENVIRON)
    assert config == RouterConfig(
        providers=(ProviderSpec("node-a", "https://node-a.example:8080", "tz-router-at-a", ("default", "big"),
                                Declared("DE", "confidential", "sev-snp")),
                   ProviderSpec("node-b", "http://10.0.0.2:8080", "tz-router-at-b", ("default",), Declared())),
        callers=(RouterCaller("alice", ALICE_SHA, CallerRequirements(False, frozenset({"DE", "FR"}),
                                                                     {"input": 2_000_000_000}), "confidential"),
                 RouterCaller("svc.batch@team-1", hash_key("tz-batch"))),
        settings=RouterSettings(poll_interval_s=1, connect_timeout_s=5.0, first_byte_timeout_s=30.5,
                                max_body_bytes=8 * 1024 * 1024))
    assert "tz-router-at" not in repr(config)


def test_a_file_on_disk_is_read_and_a_missing_or_broken_one_named(tmp_path: Path) -> None:
    path = tmp_path / "providers.yaml"
    path.write_text(EXAMPLE)
    assert load_router_config(path, ENVIRON) == parse_router_config(example(), ENVIRON)
    with pytest.raises(RouterConfigError, match=r"cannot read the providers file .*missing.yaml"):
        load_router_config(tmp_path / "missing.yaml", ENVIRON)
    path.write_text("providers: [")
    with pytest.raises(RouterConfigError, match="is not valid YAML"):
        load_router_config(path, ENVIRON)


def edited(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """The example with one value replaced (or removed, for value None at a mapping key)."""
    raw = copy.deepcopy(example())
    target = raw
    for step in path[:-1]:
        target = target[step]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return raw


@pytest.mark.parametrize(("path", "value", "message"), [
    (("routers",), [], "unknown key(s) in the providers file: routers; allowed: settings, providers, callers"),
    (("providers",), [], "'providers' must be a non-empty list of nodes"),
    (("providers", 0, "region"), "eu", "unknown key(s) in providers[0]: region; allowed: name, url, api_key, "
                                       "api_key_env, models, jurisdiction, trust_tier, evidence"),
    (("providers", 0, "name"), "node a", "providers[0].name must be 1-64 letters, digits, '_', '.' or '-'"),
    (("providers", 1, "name"), "node-a", "provider name(s) node-a appear more than once"),
    (("providers", 0, "url"), "ftp://node-a", "providers[0] (node-a).url must be an http(s) base URL"),
    (("providers", 0, "url"), "https://node-a/?x=1", "providers[0] (node-a).url must be an http(s) base URL"),
    (("providers", 0, "api_key"), "tz-both", "providers[0] (node-a) needs exactly one of api_key"),
    (("providers", 0, "api_key_env"), None, "providers[0] (node-a) needs exactly one of api_key"),
    (("providers", 0, "api_key_env"), "UNSET_KEY", "providers[0] (node-a).api_key_env names 'UNSET_KEY', which is "
                                                   "not set in the environment"),
    (("providers", 1, "api_key"), " tz-x", "providers[1] (node-b)'s API key must be a non-empty ASCII string"),
    (("providers", 0, "models"), [], "providers[0] (node-a).models must be a non-empty list"),
    (("providers", 0, "jurisdiction"), "de", "providers[0] (node-a).jurisdiction must be an ISO 3166-1 alpha-2"),
    (("providers", 0, "jurisdiction"), False, "providers[0] (node-a).jurisdiction was read as false: write the code "
                                              "in quotes"),
    (("providers", 0, "trust_tier"), "gold", "providers[0] (node-a).trust_tier must be one of standard, "
                                             "confidential, got 'gold'"),
    (("providers", 0, "evidence"), "sgx", "providers[0] (node-a).evidence must be one of none, sev-snp, tdx"),
    (("settings", "poll_interval_s"), 0, "settings.poll_interval_s must be a positive number, got 0"),
    (("settings", "max_body_bytes"), 1.5, "settings.max_body_bytes must be a positive whole number, got 1.5"),
    (("settings", "retries"), 3, "unknown key(s) in settings: retries; allowed: poll_interval_s, "
                                 "connect_timeout_s, first_byte_timeout_s, max_body_bytes"),
    (("callers",), {}, "'callers' must be a mapping naming at least one caller"),
    (("callers", "bad name"), {"key_sha256": ALICE_SHA}, "caller name 'bad name' must be 1-64 letters"),
    (("callers", "alice", "key_sha256"), "tz-alice", "callers.alice.key_sha256 must be the SHA-256"),
    (("callers", "alice", "role"), "caller", "unknown key(s) in callers.alice: role; allowed: key_sha256, "
                                             "requirements, min_trust_tier"),
    (("callers", "alice", "min_trust_tier"), "gold", "callers.alice.min_trust_tier must be one of standard, "
                                                     "confidential, got 'gold'"),
    (("callers", "alice", "requirements"), {"tee": True}, "unknown key(s) in callers.alice.requirements: tee"),
    (("callers", "svc.batch@team-1", "key_sha256"), ALICE_SHA, "two callers share a key_sha256"),
])
def test_a_malformed_file_is_refused_naming_the_key(path: tuple[Any, ...], value: Any, message: str) -> None:
    with pytest.raises(RouterConfigError) as raised:
        parse_router_config(edited(path, value), ENVIRON)
    assert str(raised.value).startswith(message)


def test_a_callers_key_finds_them_and_anything_else_is_refused() -> None:
    keys = CallerKeys(parse_router_config(example(), ENVIRON).callers)
    assert keys.caller_for("Bearer tz-alice").name == "alice"
    assert keys.caller_for("bearer  tz-batch ").name == "svc.batch@team-1"
    for header, message in [(None, "missing API key: send the header 'Authorization: Bearer <key>'"),
                            ("tz-alice", "malformed Authorization header: expected 'Bearer <key>'"),
                            ("Bearer ", "malformed Authorization header: expected 'Bearer <key>'"),
                            ("Bearer tz-bob", "invalid API key"), ("Bearer tz-alicé", "invalid API key")]:
        with pytest.raises(Unauthenticated) as raised:
            keys.caller_for(header)
        assert (raised.value.message, raised.value.code) == (message, "invalid_api_key")
