"""The node policy (policies/node_policy.py): the shipped files, every rejection, the declared tier, hardware."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.node_policy import (
    NodePolicy,
    NodePolicyError,
    NodeRequirements,
    hardware_unmet,
    load_node_policy,
    parse_node_policy,
    tls_unmet,
    with_jurisdiction,
)
from policies.requirements import Unmet

ALL_ON = NodeRequirements(memory_locked=True, no_swap=True, sealing=True, confidential_hardware=True, tls=True)
ALL_OFF = NodeRequirements(memory_locked=False, no_swap=False, sealing=False, confidential_hardware=False,
                           tls=False)
REQUIRE_ALL = {"memory_locked": True, "no_swap": True, "sealing": True, "confidential_hardware": True, "tls": True}


def policy(**changes: Any) -> dict[str, Any]:
    """A valid policy document with `changes` applied; a value of None removes the key."""
    raw: dict[str, Any] = {"jurisdiction": "DE", "trust_tier": "standard",
                           "require": {"memory_locked": True, "no_swap": False, "sealing": True,
                                       "confidential_hardware": False, "tls": False}}
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    return raw


def test_the_shipped_policies_load() -> None:
    assert load_node_policy("confidential") == NodePolicy("confidential", None, "confidential", ALL_ON)
    assert load_node_policy("standard") == NodePolicy("standard", None, "standard", ALL_OFF)


def test_a_policy_file_by_path_loads(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(textwrap.dedent("""\
        jurisdiction: FR
        trust_tier: standard
        require: {memory_locked: true, no_swap: false, sealing: true, confidential_hardware: false, tls: true}
    """))
    assert load_node_policy(str(path)) == NodePolicy("site", "FR", "standard", NodeRequirements(True, False, True,
                                                                                                  False, True))


def test_as_json_names_every_field() -> None:
    assert parse_node_policy(policy(), "site").as_json() == {
        "name": "site", "jurisdiction": "DE", "trust_tier": "standard",
        "require": {"memory_locked": True, "no_swap": False, "sealing": True, "confidential_hardware": False,
                    "tls": False}}
    assert load_node_policy("standard").as_json()["jurisdiction"] is None


def test_unset_declares_no_jurisdiction_and_a_quoted_no_is_norway() -> None:
    assert parse_node_policy(policy(jurisdiction="unset"), "site").jurisdiction is None
    assert parse_node_policy(yaml.safe_load(yaml.safe_dump(policy(jurisdiction="NO"))), "site").jurisdiction == "NO"


def test_a_confidential_tier_with_every_requirement_on_is_accepted() -> None:
    raw = policy(trust_tier="confidential", require=REQUIRE_ALL)
    assert parse_node_policy(raw, "site") == NodePolicy("site", "DE", "confidential", ALL_ON)


@pytest.mark.parametrize(("raw", "message"), [
    (["jurisdiction"], "'policy' in node policy 'site' must be a mapping"),
    (None, "'policy' in node policy 'site' must be a mapping"),
    (policy(name="strict"),
     "unknown key(s) in 'policy' of node policy 'site': name; allowed: jurisdiction, trust_tier, require"),
    (policy(jurisdiction=None),
     "missing key(s) in 'policy' of node policy 'site': jurisdiction; every key is written out"),
    (policy(trust_tier=None, require=None),
     "missing key(s) in 'policy' of node policy 'site': trust_tier, require; every key is written out"),
    (policy(require=["memory_locked"]), "'require' in node policy 'site' must be a mapping"),
    (policy(require={**REQUIRE_ALL, "no_dumps": True}),
     "unknown key(s) in 'require' of node policy 'site': no_dumps; allowed: memory_locked, no_swap, sealing, "
     "confidential_hardware, tls"),
    (policy(require={"memory_locked": True, "no_swap": True, "sealing": True}),
     "missing key(s) in 'require' of node policy 'site': confidential_hardware, tls; every key is written out"),
    (policy(require={**REQUIRE_ALL, "tls": "on"}), "'require.tls' in node policy 'site' must be true or false"),
    (policy(require={**REQUIRE_ALL, "memory_locked": "yes please"}),
     "'require.memory_locked' in node policy 'site' must be true or false"),
    (policy(require={**REQUIRE_ALL, "sealing": 1}), "'require.sealing' in node policy 'site' must be true or false"),
    (policy(trust_tier="gold"),
     "'trust_tier' in node policy 'site' must be one of standard, confidential, got 'gold'"),
    (policy(trust_tier="confidential"),
     "trust_tier 'confidential' in node policy 'site' needs every requirement on; off: no_swap, "
     "confidential_hardware, tls: set them true or declare trust_tier: standard"),
    (policy(trust_tier="confidential", require={**REQUIRE_ALL, "tls": False}),
     "trust_tier 'confidential' in node policy 'site' needs every requirement on; off: tls: set them true or "
     "declare trust_tier: standard"),
    (policy(jurisdiction="de"),
     "'jurisdiction' in node policy 'site' must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE) or "
     "unset (none declared), got 'de'"),
    (policy(jurisdiction="DEU"),
     "'jurisdiction' in node policy 'site' must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE) or "
     "unset (none declared), got 'DEU'"),
    (policy(jurisdiction="EU "),
     "'jurisdiction' in node policy 'site' must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE) or "
     "unset (none declared), got 'EU '"),
    (policy(jurisdiction=49),
     "'jurisdiction' in node policy 'site' must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE) or "
     "unset (none declared), got 49"),
    (yaml.safe_load("jurisdiction: NO\ntrust_tier: standard\nrequire: {memory_locked: false, no_swap: false, "
                    "sealing: false, confidential_hardware: false, tls: false}\n"),
     "'jurisdiction' in node policy 'site' was read as false: write the code in quotes, e.g. 'NO'"),
])
def test_a_malformed_policy_is_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(NodePolicyError) as raised:
        parse_node_policy(raw, "site")
    assert str(raised.value) == message


def test_a_null_jurisdiction_is_refused_in_favour_of_unset(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("jurisdiction: null\ntrust_tier: standard\nrequire: {memory_locked: false, no_swap: false, "
                    "sealing: false, confidential_hardware: false, tls: false}\n")
    with pytest.raises(NodePolicyError) as raised:
        load_node_policy(str(path))
    assert str(raised.value) == ("'jurisdiction' in node policy 'site' must be an ISO 3166-1 alpha-2 country code in "
                                 "upper case (e.g. DE) or unset (none declared), got None")


def test_an_unknown_policy_name_is_refused() -> None:
    with pytest.raises(NodePolicyError) as raised:
        load_node_policy("pricing")
    assert str(raised.value) == ("no node policy 'pricing': name one of confidential, standard or give the path of a "
                                 "YAML file")


def test_a_file_that_is_not_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("require: {memory_locked: true\n")
    with pytest.raises(NodePolicyError) as raised:
        load_node_policy(str(path))
    assert str(raised.value).startswith(f"{path} is not valid YAML: ")


def test_the_operator_declares_the_jurisdiction_at_start() -> None:
    standard = load_node_policy("standard")
    assert with_jurisdiction(standard, "CH") == NodePolicy("standard", "CH", "standard", ALL_OFF)
    for bad in ("ch", "unset", "", "EU1"):
        with pytest.raises(NodePolicyError) as raised:
            with_jurisdiction(standard, bad)
        assert str(raised.value) == ("the jurisdiction must be an ISO 3166-1 alpha-2 country code in upper case "
                                     f"(e.g. DE), got {bad!r}")


def test_hardware_unmet_refuses_no_tee_and_unverified_evidence_when_required() -> None:
    confidential = load_node_policy("confidential")
    assert hardware_unmet(confidential, "none", False) == (Unmet(
        "require.confidential_hardware",
        "node policy 'confidential' requires confidential hardware, and its attestation evidence is none (no TEE): "
        "run the node in a confidential VM (SEV-SNP or TDX) whose evidence verifies, or use a policy with "
        "confidential_hardware: false"),)
    assert hardware_unmet(confidential, "tdx", False) == (Unmet(
        "require.confidential_hardware",
        "node policy 'confidential' requires confidential hardware, and its tdx attestation evidence did not "
        "verify: run the node in a confidential VM (SEV-SNP or TDX) whose evidence verifies, or use a policy with "
        "confidential_hardware: false"),)
    assert hardware_unmet(confidential, "sev-snp", True) == ()
    assert hardware_unmet(confidential, "tdx", True) == ()


def test_hardware_unmet_is_empty_when_the_policy_does_not_require_it() -> None:
    standard = load_node_policy("standard")
    assert hardware_unmet(standard, "none", False) == ()
    assert hardware_unmet(standard, "sev-snp", False) == ()


def test_tls_unmet_refuses_plain_http_only_where_the_policy_requires_tls() -> None:
    confidential = load_node_policy("confidential")
    assert tls_unmet(confidential, tls=False) == (Unmet(
        "require.tls",
        "node policy 'confidential' requires TLS, and --no-tls asks for plain HTTP, which whoever relays the "
        "connection reads: serve without --no-tls (TLS is on by default under this policy), or use a policy with "
        "tls: false for local development"),)
    assert tls_unmet(confidential, tls=True) == ()
    assert tls_unmet(load_node_policy("standard"), tls=False) == ()
