"""The node config file and `tenzro keys add`: keys printed once, only hashes stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.auth import KeyRing
from node.config import ConfigError, add_key, hash_key, load_config, parse_config
from node.errors import ApiError
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
        with pytest.raises(ApiError) as error:
            ring.caller_for(header)
        assert error.value.status == 401


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({"limit": {}})
    with pytest.raises(ConfigError, match="cache.node_bytes"):
        parse_config({"cache": {"node_bytes": -1}})
    parsed = parse_config({"cache": {"node_bytes": 10, "caller_bytes": 5}, "limits": {"max_queue": 3}})
    assert (parsed.cache.node_bytes, parsed.cache.caller_bytes, parsed.limits.max_queue) == (10, 5, 3)
    with pytest.raises(ConfigError, match="caller name"):
        add_key(Path("/nonexistent/x.yaml"), "bad name!")
