"""Caller requirements (policies/requirements.py): node.yaml and headers, merge, and what an offer leaves unmet."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from policies.requirements import (
    NO_REQUIREMENTS,
    TOKEN_CLASSES,
    CallerRequirements,
    Offer,
    RequirementHeaderError,
    RequirementsError,
    Unmet,
    merge,
    parse_requirements,
    requirements_from_headers,
    unmet,
)

WHERE = "callers.alice.requirements"
PRICES = {"input": 1_000_000_000, "output": 4_000_000_000, "cached_read": 100_000_000,
          "cached_write": 1_250_000_000}
TEE_IN_DE = Offer(evidence_type="sev-snp", trusted=True, jurisdiction="DE", price_wei=PRICES)


def test_requirements_parse_from_node_yaml() -> None:
    raw = yaml.safe_load("""
        confidential_hardware: true
        jurisdictions: [DE, FR, 'NO']
        max_price_wei: {input: 2000000000, cached_write: 0}
    """)
    parsed = parse_requirements(raw, WHERE)
    assert parsed == CallerRequirements(True, frozenset({"DE", "FR", "NO"}), {"input": 2_000_000_000,
                                                                             "cached_write": 0})
    assert dict(parsed.max_price_wei) == {"input": 2_000_000_000, "cached_write": 0}


def test_keys_left_out_require_nothing() -> None:
    assert parse_requirements({}, WHERE) == NO_REQUIREMENTS
    assert parse_requirements({"confidential_hardware": False}, WHERE) == NO_REQUIREMENTS
    assert parse_requirements({"max_price_wei": {}}, WHERE) == NO_REQUIREMENTS
    assert NO_REQUIREMENTS == CallerRequirements(False, None, {})


@pytest.mark.parametrize(("raw", "message"), [
    (None, f"{WHERE} must be a mapping"),
    (["confidential_hardware"], f"{WHERE} must be a mapping"),
    ({"confidential": True, "tee": True},
     f"unknown key(s) in {WHERE}: confidential, tee; allowed: confidential_hardware, jurisdictions, max_price_wei"),
    ({"confidential_hardware": "yes"}, f"{WHERE}.confidential_hardware must be true or false, got 'yes'"),
    ({"confidential_hardware": 1}, f"{WHERE}.confidential_hardware must be true or false, got 1"),
    ({"jurisdictions": "DE"}, f"{WHERE}.jurisdictions must be a list of country codes, e.g. [DE, FR]"),
    ({"jurisdictions": []}, f"{WHERE}.jurisdictions must name at least one jurisdiction; leave it out to accept any"),
    ({"jurisdictions": ["DE", "fr"]},
     f"{WHERE}.jurisdictions[1] must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE), got 'fr'"),
    ({"jurisdictions": ["EU-27"]},
     f"{WHERE}.jurisdictions[0] must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE), got 'EU-27'"),
    (yaml.safe_load("jurisdictions: [DE, NO]"),
     f"{WHERE}.jurisdictions[1] was read as false: write the code in quotes, e.g. 'NO'"),
    ({"max_price_wei": 5}, f"{WHERE}.max_price_wei must be a mapping"),
    ({"max_price_wei": {"prompt": 5, "input": 1}},
     f"unknown key(s) in {WHERE}.max_price_wei: prompt; allowed: input, output, cached_read, cached_write"),
    ({"max_price_wei": {"output": -1}},
     f"{WHERE}.max_price_wei.output must be a whole number of wei per token, 0 to 2**256-1, got -1"),
    ({"max_price_wei": {"input": 1.5e9}},
     f"{WHERE}.max_price_wei.input must be a whole number of wei per token, 0 to 2**256-1, got 1500000000.0"),
    ({"max_price_wei": {"cached_read": True}},
     f"{WHERE}.max_price_wei.cached_read must be a whole number of wei per token, 0 to 2**256-1, got True"),
    ({"max_price_wei": {"cached_write": "5"}},
     f"{WHERE}.max_price_wei.cached_write must be a whole number of wei per token, 0 to 2**256-1, got '5'"),
    ({"max_price_wei": {"input": 2**256}},
     f"{WHERE}.max_price_wei.input must be a whole number of wei per token, 0 to 2**256-1, got {2**256}"),
])
def test_malformed_requirements_are_refused_naming_the_path(raw: Any, message: str) -> None:
    with pytest.raises(RequirementsError) as raised:
        parse_requirements(raw, WHERE)
    assert str(raised.value) == message


def test_as_config_writes_only_what_is_required_and_reads_back_equal() -> None:
    strict = CallerRequirements(True, frozenset({"FR", "DE"}), {"output": 7, "input": 3})
    assert strict.as_config() == {"confidential_hardware": True, "jurisdictions": ["DE", "FR"],
                                  "max_price_wei": {"input": 3, "output": 7}}
    assert NO_REQUIREMENTS.as_config() == {}
    assert parse_requirements(yaml.safe_load(yaml.safe_dump(strict.as_config())), WHERE) == strict


def test_an_unknown_token_class_is_refused_by_the_constructors() -> None:
    with pytest.raises(RequirementsError) as raised:
        CallerRequirements(max_price_wei={"prompt": 1})
    assert str(raised.value) == "unknown token class(es) prompt; allowed: input, output, cached_read, cached_write"
    with pytest.raises(RequirementsError) as raised:
        Offer("none", False, None, {"input": 1, "output": 1})
    assert str(raised.value) == "an offer prices every token class; missing: cached_read, cached_write"


def test_the_price_mapping_cannot_be_changed_after_construction_and_hashes_by_value() -> None:
    prices = {"output": 7, "input": 5}
    requirements = CallerRequirements(max_price_wei=prices)
    prices["input"] = 500
    assert requirements.max_price_wei == {"input": 5, "output": 7}
    assert list(requirements.max_price_wei) == ["input", "output"]  # TOKEN_CLASSES order
    with pytest.raises(TypeError):
        requirements.max_price_wei["input"] = 6  # type: ignore[index]
    assert hash(requirements) == hash(CallerRequirements(max_price_wei={"input": 5, "output": 7}))
    assert requirements != CallerRequirements(max_price_wei={"input": 5, "output": 8})


def test_requirements_parse_from_headers() -> None:
    headers = {"Tenzro-Require-Confidential": "true", "Tenzro-Jurisdictions": "DE, FR,NO",
               "Tenzro-Max-Price-Wei": " input=2000000000, output = 8000000000 ", "Authorization": "Bearer x",
               "Tenzro-Trace": "ignored: not a requirement header"}
    assert requirements_from_headers(headers) == CallerRequirements(
        True, frozenset({"DE", "FR", "NO"}), {"input": 2_000_000_000, "output": 8_000_000_000})


def test_header_names_match_without_regard_to_case_and_absent_headers_require_nothing() -> None:
    assert requirements_from_headers({"tenzro-require-confidential": "false", "TENZRO-JURISDICTIONS": "CH"}) == (
        CallerRequirements(False, frozenset({"CH"}), {}))
    assert requirements_from_headers({}) == NO_REQUIREMENTS
    assert requirements_from_headers(CIMultiDict({"Content-Type": "application/json"})) == NO_REQUIREMENTS


PRICE_FORM = ("must be CLASS=WEI with CLASS one of input, output, cached_read, cached_write and WEI a whole number, "
              "e.g. input=2000000000")


@pytest.mark.parametrize(("headers", "header", "message"), [
    ({"Tenzro-Require-Confidential": "yes"}, "Tenzro-Require-Confidential",
     "Tenzro-Require-Confidential must be true or false, got 'yes'"),
    ({"Tenzro-Require-Confidential": "True"}, "Tenzro-Require-Confidential",
     "Tenzro-Require-Confidential must be true or false, got 'True'"),
    ({"Tenzro-Require-Confidential": ""}, "Tenzro-Require-Confidential",
     "Tenzro-Require-Confidential must be true or false, got ''"),
    ({"Tenzro-Jurisdictions": ""}, "Tenzro-Jurisdictions",
     "Tenzro-Jurisdictions has an empty item: separate items with single commas"),
    ({"Tenzro-Jurisdictions": "DE,,FR"}, "Tenzro-Jurisdictions",
     "Tenzro-Jurisdictions has an empty item: separate items with single commas"),
    ({"Tenzro-Jurisdictions": "DE;FR"}, "Tenzro-Jurisdictions",
     "Tenzro-Jurisdictions[0] must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE), got 'DE;FR'"),
    ({"Tenzro-Jurisdictions": "DE,fr"}, "Tenzro-Jurisdictions",
     "Tenzro-Jurisdictions[1] must be an ISO 3166-1 alpha-2 country code in upper case (e.g. DE), got 'fr'"),
    ({"Tenzro-Max-Price-Wei": "input"}, "Tenzro-Max-Price-Wei", f"Tenzro-Max-Price-Wei item 'input' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "prompt=5"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'prompt=5' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input=-5"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'input=-5' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input=1e9"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'input=1e9' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input=1_000"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'input=1_000' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input="}, "Tenzro-Max-Price-Wei", f"Tenzro-Max-Price-Wei item 'input=' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input=1=2"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'input=1=2' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": "input=" + "9" * 79}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei item 'input={'9' * 79}' {PRICE_FORM}"),
    ({"Tenzro-Max-Price-Wei": f"input={2**256}"}, "Tenzro-Max-Price-Wei",
     f"Tenzro-Max-Price-Wei input must be a whole number of wei per token, 0 to 2**256-1, got {2**256}"),
    ({"Tenzro-Max-Price-Wei": "input=5,output=6,input=7"}, "Tenzro-Max-Price-Wei",
     "Tenzro-Max-Price-Wei names input more than once"),
    ({"Tenzro-Max-Price-Wei": "input=5,"}, "Tenzro-Max-Price-Wei",
     "Tenzro-Max-Price-Wei has an empty item: separate items with single commas"),
    ({"Tenzro-Jurisdiction": "DE"}, "Tenzro-Jurisdiction",
     "unknown requirement header Tenzro-Jurisdiction; the requirement headers are Tenzro-Require-Confidential, "
     "Tenzro-Jurisdictions, Tenzro-Max-Price-Wei"),
    ({"tenzro-require-tee": "true"}, "tenzro-require-tee",
     "unknown requirement header tenzro-require-tee; the requirement headers are Tenzro-Require-Confidential, "
     "Tenzro-Jurisdictions, Tenzro-Max-Price-Wei"),
    ({"Tenzro-Max-Price": "input=5"}, "Tenzro-Max-Price",
     "unknown requirement header Tenzro-Max-Price; the requirement headers are Tenzro-Require-Confidential, "
     "Tenzro-Jurisdictions, Tenzro-Max-Price-Wei"),
    (CIMultiDict([("Tenzro-Jurisdictions", "DE"), ("tenzro-jurisdictions", "US")]), "Tenzro-Jurisdictions",
     "Tenzro-Jurisdictions was sent more than once; send it once"),
])
def test_a_malformed_header_is_refused_naming_it(headers: Any, header: str, message: str) -> None:
    with pytest.raises(RequirementHeaderError) as raised:
        requirements_from_headers(headers)
    assert (raised.value.header, str(raised.value)) == (header, message)


def test_merge_keeps_the_stricter_of_each_requirement() -> None:
    configured = CallerRequirements(True, frozenset({"DE", "FR"}), {"input": 10, "output": 40})
    requested = CallerRequirements(False, frozenset({"FR", "NL"}), {"input": 20, "output": 30, "cached_read": 1})
    assert merge(configured, requested) == CallerRequirements(True, frozenset({"FR"}), {"input": 10, "output": 30,
                                                                                         "cached_read": 1})
    assert merge(requested, configured) == merge(configured, requested)


def test_a_request_cannot_widen_what_the_config_requires() -> None:
    configured = CallerRequirements(True, frozenset({"DE"}), {"input": 10})
    widening = requirements_from_headers({"Tenzro-Require-Confidential": "false", "Tenzro-Jurisdictions": "DE,US",
                                          "Tenzro-Max-Price-Wei": "input=99"})
    assert merge(configured, widening) == configured


def test_merge_with_nothing_required_on_one_side_keeps_the_other() -> None:
    requested = CallerRequirements(False, frozenset({"NL"}), {"cached_write": 2})
    assert merge(NO_REQUIREMENTS, requested) == requested
    assert merge(requested, NO_REQUIREMENTS) == requested
    assert merge(NO_REQUIREMENTS, NO_REQUIREMENTS) == NO_REQUIREMENTS


def test_lists_that_do_not_overlap_merge_to_no_acceptable_jurisdiction() -> None:
    merged = merge(CallerRequirements(jurisdictions=frozenset({"DE"})),
                   CallerRequirements(jurisdictions=frozenset({"US"})))
    assert merged.jurisdictions == frozenset()
    assert unmet(merged, TEE_IN_DE) == (Unmet(
        "jurisdiction", "no jurisdiction is acceptable (the configured and the requested jurisdictions do not "
                        "overlap); this node declares DE"),)


def test_an_offer_that_meets_every_requirement_leaves_none_unmet() -> None:
    strict = CallerRequirements(True, frozenset({"DE", "FR"}), dict(PRICES))
    assert unmet(strict, TEE_IN_DE) == ()
    assert unmet(NO_REQUIREMENTS, Offer("none", False, None, PRICES)) == ()


def test_confidential_hardware_is_unmet_without_a_tee_or_with_evidence_that_did_not_verify() -> None:
    required = CallerRequirements(confidential_hardware=True)
    assert unmet(required, Offer("none", False, "DE", PRICES)) == (Unmet(
        "confidential_hardware", "confidential hardware required; this node does not offer it: its attestation "
                                 "evidence is none (no TEE)"),)
    assert unmet(required, Offer("tdx", False, "DE", PRICES)) == (Unmet(
        "confidential_hardware", "confidential hardware required; this node does not offer it: its tdx attestation "
                                 "evidence did not verify"),)


def test_jurisdiction_is_unmet_elsewhere_and_when_the_node_declares_none() -> None:
    required = CallerRequirements(jurisdictions=frozenset({"FR", "CH"}))
    assert unmet(required, TEE_IN_DE) == (Unmet("jurisdiction", "jurisdiction CH or FR required; this node declares "
                                                                "DE"),)
    undeclared = Offer("sev-snp", True, None, PRICES)
    assert unmet(required, undeclared) == (Unmet("jurisdiction", "jurisdiction CH or FR required; this node declares "
                                                                 "no jurisdiction (unset)"),)


@pytest.mark.parametrize("token_class", TOKEN_CLASSES)
def test_a_price_above_the_ceiling_is_unmet_for_its_class(token_class: str) -> None:
    ceiling = PRICES[token_class] - 1
    required = CallerRequirements(max_price_wei={token_class: ceiling})
    assert unmet(required, TEE_IN_DE) == (Unmet(
        f"max_price_wei.{token_class}",
        f"{token_class} price at most {ceiling} wei per token required; this node charges {PRICES[token_class]}"),)
    assert unmet(CallerRequirements(max_price_wei={token_class: PRICES[token_class]}), TEE_IN_DE) == ()


def test_every_unmet_requirement_is_listed_in_a_fixed_order() -> None:
    required = CallerRequirements(True, frozenset({"FR"}), {"cached_write": 0, "input": 0, "output": 10**10})
    assert [item.requirement for item in unmet(required, Offer("none", False, "DE", PRICES))] == [
        "confidential_hardware", "jurisdiction", "max_price_wei.input", "max_price_wei.cached_write"]


CODES = st.sampled_from(["DE", "FR", "NL", "CH", "US"])
REQUIREMENTS = st.builds(
    CallerRequirements,
    confidential_hardware=st.booleans(),
    jurisdictions=st.none() | st.frozensets(CODES, min_size=1),
    max_price_wei=st.dictionaries(st.sampled_from(TOKEN_CLASSES), st.integers(0, 10)),
)
OFFERS = st.builds(
    Offer,
    evidence_type=st.sampled_from(["none", "sev-snp", "tdx"]),
    trusted=st.booleans(),
    jurisdiction=st.none() | CODES,
    price_wei=st.fixed_dictionaries({name: st.integers(0, 10) for name in TOKEN_CLASSES}),
)


def at_least_as_strict(stricter: CallerRequirements, other: CallerRequirements) -> bool:
    jurisdictions = other.jurisdictions is None or (stricter.jurisdictions is not None
                                                    and stricter.jurisdictions <= other.jurisdictions)
    prices = all(name in stricter.max_price_wei and stricter.max_price_wei[name] <= ceiling
                 for name, ceiling in other.max_price_wei.items())
    return (stricter.confidential_hardware >= other.confidential_hardware) and jurisdictions and prices


@given(REQUIREMENTS, REQUIREMENTS, OFFERS)
def test_merged_requirements_are_never_weaker_than_either_input(
        configured: CallerRequirements, requested: CallerRequirements, offer: Offer) -> None:
    merged = merge(configured, requested)
    assert at_least_as_strict(merged, configured) and at_least_as_strict(merged, requested)
    refused_by = {item.requirement for item in unmet(configured, offer) + unmet(requested, offer)}
    assert refused_by <= {item.requirement for item in unmet(merged, offer)}
    assert merge(requested, configured) == merged


@given(REQUIREMENTS)
def test_requirements_survive_node_yaml(requirements: CallerRequirements) -> None:
    assert parse_requirements(yaml.safe_load(yaml.safe_dump(requirements.as_config())), WHERE) == requirements
