"""The node config file and `tenzro keys add`: keys printed once, only hashes stored."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from node.auth import KeyRing
from node.config import ConfigError, Group, add_key, hash_key, load_config, parse_config, remove_key, save_config
from node.errors import Unauthenticated
from policies.requirements import NO_REQUIREMENTS, CallerRequirements
from tests.node.conftest import tenzro


def test_keys_add_prints_the_key_last_and_stores_only_its_hash(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    result = tenzro("keys", "add", "alice", "--config", str(config), env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    assert key.startswith("tz-") and len(key) > 40
    text = config.read_text()
    assert key not in text and hash_key(key) in text
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    assert load_config(config).callers[0].name == "alice"


def test_keyring_maps_keys_to_callers_and_sees_new_keys_without_restart(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    alice = add_key(config, "alice")
    ring = KeyRing(config)
    assert ring.caller_for(f"Bearer {alice}").name == "alice"
    bob = add_key(config, "bob", role="auditor")
    assert ring.caller_for(f"Bearer {bob}").role == "auditor"
    for header in (None, "", "Bearer ", "Basic abc", f"Bearer {alice}x"):
        with pytest.raises(Unauthenticated) as error:
            ring.caller_for(header)
        assert error.value.code == "invalid_api_key"


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({"limit": {}})
    with pytest.raises(ConfigError, match="cache.node_bytes"):
        parse_config({"cache": {"node_bytes": -1}})
    parsed = parse_config({"cache": {"node_bytes": 10, "caller_bytes": 5}, "limits": {"max_queue": 3}})
    assert (parsed.cache.node_bytes, parsed.cache.caller_bytes, parsed.limits.max_queue) == (10, 5, 3)
    assert parsed.limits.lane_bytes is None  # the device's (node.engine.device.LANE_BYTES)
    assert parse_config({"limits": {"lane_bytes": 0}}).limits.lane_bytes == 0
    with pytest.raises(ConfigError, match="limits.lane_bytes"):
        parse_config({"limits": {"lane_bytes": -1}})
    assert parsed.reserve_bytes == 1024**3 and parse_config({"cache": {"reserve_bytes": 0}}).reserve_bytes == 0
    with pytest.raises(ConfigError, match="cache.reserve_bytes"):
        parse_config({"cache": {"reserve_bytes": -1}})
    with pytest.raises(ConfigError, match="caller name"):
        add_key(Path("/nonexistent/x.yaml"), "bad name!")


def test_a_callers_default_time_to_live_is_its_own_else_the_nodes(tmp_path: Path) -> None:
    assert parse_config({}).default_ttl_s == 300
    with pytest.raises(ConfigError, match="cache.default_ttl_s"):
        parse_config({"cache": {"default_ttl_s": 0}})
    config = tmp_path / "node.yaml"
    add_key(config, "alice")
    add_key(config, "bob", ttl_s=7200)
    save_config(config, replace(load_config(config), default_ttl_s=600))
    assert load_config(config).default_ttl_s == 600
    save_config(config, replace(load_config(config), groups=(Group("team", ("alice", "bob")),)))
    ring = KeyRing(config)
    assert (ring.ttl_of("alice"), ring.ttl_of("bob"), ring.ttl_of("carol")) == (600, 7200, None)
    assert (ring.ttl_of("group:team"), ring.ttl_of("team"), ring.ttl_of("group:other")) == (600, None, None)


def test_device_bytes_and_the_prefill_chunk_are_left_to_the_device_unless_set(tmp_path: Path) -> None:
    """Unset, both are None (`node.engine.device` sizes them at start) and stay unset through a save; set, they are
    validated like the other keys and kept."""
    defaults = parse_config({})
    assert (defaults.device_bytes, defaults.limits.prefill_chunk) == (None, None)
    path = tmp_path / "node.yaml"
    add_key(path, "alice")
    assert "device_bytes" not in path.read_text() and "prefill_chunk" not in path.read_text()
    assert (load_config(path).device_bytes, load_config(path).limits.prefill_chunk) == (None, None)
    parsed = parse_config({"cache": {"device_bytes": 0}, "limits": {"prefill_chunk": 512}})
    assert (parsed.device_bytes, parsed.limits.prefill_chunk) == (0, 512)
    save_config(path, replace(load_config(path), device_bytes=8 * 1024**3))
    assert load_config(path).device_bytes == 8 * 1024**3
    for raw, key in (({"cache": {"device_bytes": -1}}, "cache.device_bytes"),
                     ({"cache": {"device_bytes": "8GiB"}}, "cache.device_bytes"),
                     ({"limits": {"prefill_chunk": 0}}, "limits.prefill_chunk")):
        with pytest.raises(ConfigError, match=key):
            parse_config(raw)


def test_caller_requirements_parse_into_the_caller_and_default_to_none() -> None:
    parsed = parse_config({"callers": {
        "alice": {"key_sha256": "a" * 64, "requirements": {"confidential_hardware": True, "jurisdictions": ["DE", "FR"],
                                                           "max_price_wei": {"input": 2_000_000_000}}},
        "bob": {"key_sha256": "b" * 64}}})
    alice, bob = parsed.callers
    assert alice.requirements == CallerRequirements(True, frozenset({"DE", "FR"}), {"input": 2_000_000_000})
    assert bob.requirements == NO_REQUIREMENTS


@pytest.mark.parametrize(("requirements", "message"), [
    ({"tee": True}, "unknown key(s) in callers.alice.requirements: tee; allowed: confidential_hardware, "
                    "jurisdictions, max_price_wei"),
    ({"jurisdictions": ["de"]}, "callers.alice.requirements.jurisdictions[0] must be an ISO 3166-1 alpha-2 country "
                                "code in upper case (e.g. DE), got 'de'"),
    ({"max_price_wei": {"output": -1}}, "callers.alice.requirements.max_price_wei.output must be a whole number of "
                                        "wei per token, 0 to 2**256-1, got -1"),
    (None, "callers.alice.requirements must be a mapping"),
])
def test_bad_caller_requirements_are_refused_naming_the_path(requirements: object, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"callers": {"alice": {"key_sha256": "a" * 64, "requirements": requirements}}})
    assert str(raised.value) == message


def test_an_unknown_caller_key_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"callers": {"alice": {"key_sha256": "a" * 64, "require": {}}}})
    assert str(raised.value) == ("callers.alice must have 'key_sha256' and optionally 'role', 'retention', 'ttl_s', "
                                 "'requirements'")


def test_caller_requirements_survive_save_and_load_and_a_new_key(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    add_key(path, "bob")
    add_key(path, "alice")
    strict = CallerRequirements(True, frozenset({"NO", "DE"}), {"cached_read": 0, "output": 8_000_000_000})
    config = load_config(path)
    save_config(path, replace(config, callers=tuple(replace(c, requirements=strict) if c.name == "alice" else c
                                                    for c in config.callers)))
    assert "'NO'" in path.read_text()  # quoted: YAML would read a bare NO as false
    assert [(c.name, c.requirements) for c in load_config(path).callers] == [("bob", NO_REQUIREMENTS),
                                                                            ("alice", strict)]
    add_key(path, "alice")  # a new key keeps what the operator required of the caller
    assert [(c.name, c.requirements) for c in load_config(path).callers] == [("bob", NO_REQUIREMENTS),
                                                                            ("alice", strict)]


def test_groups_name_callers_of_the_file_each_in_one_group_at_most() -> None:
    callers = {name: {"key_sha256": name} for name in ("a", "b", "c")}
    parsed = parse_config({"callers": callers, "groups": {"team": {"members": ["a", "b"]}}})
    assert [(group.name, group.members) for group in parsed.groups] == [("team", ("a", "b"))]
    routed = parse_config({"callers": {**callers, "r": {"key_sha256": "r", "role": "router"}},
                           "groups": {"team": {"members": ["r/alice", "c"]}}})
    assert routed.groups[0].members == ("r/alice", "c")  # a caller router r acts for
    for groups, message in (({"team": {"members": ["z"]}}, "'z' is neither a caller"),
                            ({"t1": {"members": ["a"]}, "t2": {"members": ["a"]}}, "already a member of group 't1'"),
                            ({"team": {"members": "a"}}, "groups.team must have only 'members'"),
                            ({"team": {"members": [], "ttl": 1}}, "groups.team must have only 'members'"),
                            ({"bad name": {"members": []}}, "group name"),
                            ({"team": {"members": ["a/alice"]}}, "'a/alice' is neither a caller")):
        with pytest.raises(ConfigError, match=message):
            parse_config({"callers": callers, "groups": groups})


def test_the_keyring_reads_memberships_now_and_reports_a_removed_group(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    add_key(config, "a")
    add_key(config, "b")
    save_config(config, replace(load_config(config), groups=parse_config(
        {"callers": {"a": {"key_sha256": "x"}, "b": {"key_sha256": "y"}},
         "groups": {"team": {"members": ["a", "b"]}}}).groups))
    removed: list[str] = []
    ring = KeyRing(config, on_removed=removed.append)
    assert (ring.group_of("a"), ring.group_of("b"), ring.group_of("c")) == ("team", "team", None)
    remove_key(config, "b")  # and its membership with it
    assert (ring.group_of("a"), ring.group_of("b"), removed) == ("team", None, ["b"])
    save_config(config, replace(load_config(config), groups=()))
    assert ring.group_of("a") is None and removed == ["b", "group:team"]
