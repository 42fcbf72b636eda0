"""A node as the router reads it: its `GET /v1/node` (router/node_info.py) and its signed prefix summaries
(router/summaries.py), against documents the fake node signs with metering's canonical JSON, as the node does."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cache.summary import SummaryError, chat_prefix_forms, completion_prefix_form
from metering.canonical import canonical_json
from policies.requirements import Offer
from router.node_info import NodeInfo, NodeInfoError, parse_node_info
from router.providers import Declared
from router.summaries import WarmView, request_prefix_forms, signed_payload, verify_summary
from tests.router.fake_provider import EPOCH, MODEL, PRICES, FakeProvider

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."}]
NEXT_TURN = [*CONVERSATION, {"role": "user", "content": "And now?"}]
ROUTER_KEY = "router-key-at-a"


def provider(**fields: Any) -> FakeProvider:
    return FakeProvider("a", ROUTER_KEY, **fields)


def node_of(fake: FakeProvider) -> NodeInfo:
    return parse_node_info(fake.node_document(), Declared())


# GET /v1/node


def test_the_node_document_gives_key_boot_offer_and_tier() -> None:
    fake = provider(jurisdiction="DE", trust_tier="confidential", evidence_type="sev-snp", trusted=True)
    assert node_of(fake) == NodeInfo(fake.public_key, fake.node_document()["key_id"], "boot-1",
                                     Offer("sev-snp", True, "DE", PRICES), "confidential")


def test_what_the_node_leaves_out_the_declaration_supplies_and_what_it_says_wins() -> None:
    declared = Declared("FR", "confidential", "tdx")
    doc = provider().node_document()
    assert parse_node_info(doc, declared).offer == Offer("none", False, None, PRICES)  # null is a declaration too
    del doc["policy"], doc["evidence"]
    info = parse_node_info(doc, declared)
    assert (info.offer.jurisdiction, info.trust_tier, info.offer.evidence_type, info.offer.trusted) == (
        "FR", "confidential", "tdx", True)


@pytest.mark.parametrize(("change", "message"), [
    ({"public_key": "ab"}, "'public_key' must be 64 hex characters"),
    ({"key_id": "0000000000000000"}, "'key_id' is not the id of 'public_key'"),
    ({"boot_id": ""}, "'boot_id' must be a non-empty string"),
    ({"prices": {"input_price_wei": "1"}}, "'prices.output_price_wei' must be a decimal string of wei"),
    ({"prices": {**{f"{name}_price_wei": "1" for name in PRICES}, "input_price_wei": "-1"}},
     "'prices.input_price_wei' must be a decimal string of wei"),
    ({"prices": {**{f"{name}_price_wei": "1" for name in PRICES}, "output_price_wei": 4}},
     "'prices.output_price_wei' must be a decimal string of wei"),
    ({"policy": {"jurisdiction": "de"}}, "'policy.jurisdiction' must be an ISO 3166-1 alpha-2 country code"),
    ({"policy": {"trust_tier": "gold"}}, "'policy.trust_tier' must be one of standard, confidential"),
    ({"evidence": {"type": "sev-snp"}}, "'evidence.trusted' must be true or false"),
])
def test_a_malformed_node_document_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(NodeInfoError) as raised:
        parse_node_info({**provider().node_document(), **change}, Declared())
    assert str(raised.value).startswith(message)


def test_evidence_of_no_tee_is_never_trusted() -> None:
    assert node_of(provider(evidence_type="none", trusted=True)).offer.trusted is False


# Summaries


def test_the_signed_bytes_are_the_canonical_json_the_node_signs() -> None:
    doc = provider(held={"alice": [CONVERSATION]}).summary_document(MODEL)
    assert signed_payload(doc) == canonical_json({key: value for key, value in doc.items() if key != "signature"})


def test_a_verified_summary_holds_the_conversations_prefixes_for_its_caller_only() -> None:
    fake = provider(held={"alice": [CONVERSATION]})
    summary = verify_summary(fake.summary_document(MODEL), node_of(fake), MODEL)
    assert (summary.model, summary.epoch, summary.entries) == (MODEL, EPOCH, 3)
    forms = chat_prefix_forms(NEXT_TURN)
    assert WarmView(summary, ROUTER_KEY, "alice").depth(forms) == 3
    assert WarmView(summary, ROUTER_KEY, "alice").depth(forms[:2]) == 2
    assert WarmView(summary, ROUTER_KEY, "alice").depth([]) == 0
    assert WarmView(summary, ROUTER_KEY, "carol").depth(forms) == 0
    assert WarmView(summary, "another-routers-key", "alice").depth(forms) == 0
    assert WarmView(summary, ROUTER_KEY, "alice").depth(chat_prefix_forms([{"role": "user", "content": "x"}])) == 0


@pytest.mark.parametrize(("change", "message"), [
    ({"entries": 4}, "the summary's signature does not verify under the node's key"),
    ({"boot_id": "boot-0"}, "the summary names another boot or key than the node's GET /v1/node"),
    ({"model": "other"}, "not a summary of model 'm'"),
    ({"signature": "00"}, "'signature' must be 128 hex characters"),
    ({"signature": "zz" * 64}, "'signature' must be 128 hex characters"),
])
def test_a_summary_that_is_not_the_nodes_own_is_refused(change: dict[str, Any], message: str) -> None:
    fake = provider(held={"alice": [CONVERSATION]})
    with pytest.raises(SummaryError) as raised:
        verify_summary({**fake.summary_document(MODEL), **change}, node_of(fake), MODEL)
    assert str(raised.value) == message


def test_a_summary_signed_by_another_key_is_refused() -> None:
    other = provider(held={"alice": [CONVERSATION]})
    other.key = Ed25519PrivateKey.from_private_bytes(bytes([1]) * 32)
    doc = other.summary_document(MODEL)
    doc["key_id"] = provider().node_document()["key_id"]  # claims the node's key id, signed by another key
    with pytest.raises(SummaryError, match="does not verify"):
        verify_summary(doc, node_of(provider()), MODEL)


def test_a_summary_missing_fields_is_refused() -> None:
    doc = provider().summary_document(MODEL)
    del doc["epoch"], doc["bloom"]
    with pytest.raises(SummaryError, match="^the summary lacks epoch, bloom$"):
        verify_summary(doc, node_of(provider()), MODEL)


def test_a_requests_prefix_forms() -> None:
    assert request_prefix_forms({"messages": NEXT_TURN}, chat=True) == chat_prefix_forms(NEXT_TURN)
    long_chat = [{"role": "user", "content": str(index)} for index in range(100)]
    assert request_prefix_forms({"messages": long_chat}, chat=True) == chat_prefix_forms(long_chat)[36:]
    assert request_prefix_forms({"prompt": "Once upon"}, chat=False) == [completion_prefix_form("Once upon")]
    assert request_prefix_forms({"prompt": [1, 2, 3]}, chat=False) == [completion_prefix_form([1, 2, 3])]
    for body, chat in [({"messages": []}, True), ({"messages": [{"role": "user"}]}, True),
                       ({"messages": "hi"}, True), ({"prompt": ["a", "b"]}, False), ({"prompt": [True]}, False),
                       ({"prompt": []}, False), ({}, False)]:
        assert request_prefix_forms(body, chat) == []
