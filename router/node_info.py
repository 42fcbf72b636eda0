"""What a node says about itself (`GET /v1/node`, no key needed): the key that signs its summaries, its boot, its
prices, jurisdiction, trust tier and attestation evidence, as the router's hard constraints and scores read them.

The node's word replaces the operator's declaration field by field: a document without `policy` or `evidence`
(a node older than those fields) leaves the declared values standing. The evidence's `trusted` is the node's own
verdict; the router does not re-verify evidence, and it does not have to for safety: it forwards the caller's
requirements, which the node enforces with its real evidence.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from policies.jurisdiction import code_problem
from policies.node_policy import TRUST_TIERS
from policies.requirements import MAX_WEI, NO_TEE, TOKEN_CLASSES, Offer
from router.providers import Declared

PRICE_FIELDS = {name: f"{name}_price_wei" for name in TOKEN_CLASSES}
"""Token class to its field in the document's `prices` (the node's price schedule names)."""
PUBLIC_KEY_BYTES = 32
KEY_ID_HEX_CHARS = 16


class NodeInfoError(ValueError):
    """A node's `GET /v1/node` document is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    public_key: bytes
    """The node start's Ed25519 public key (32 raw bytes): it signs the node's summaries."""
    key_id: str
    boot_id: str
    offer: Offer
    trust_tier: str


def key_id_for(public_key: bytes) -> str:
    """The first 16 hex characters of SHA-256 of the raw key: metering's key id, which summaries name."""
    return hashlib.sha256(public_key).hexdigest()[:KEY_ID_HEX_CHARS]


def _text(doc: dict[str, Any], name: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not value:
        raise NodeInfoError(f"'{name}' must be a non-empty string")
    return value


def _public_key(doc: dict[str, Any]) -> bytes:
    text = _text(doc, "public_key")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != PUBLIC_KEY_BYTES or len(text) != 2 * PUBLIC_KEY_BYTES:
        raise NodeInfoError(f"'public_key' must be {2 * PUBLIC_KEY_BYTES} hex characters")
    if _text(doc, "key_id") != key_id_for(raw):
        raise NodeInfoError("'key_id' is not the id of 'public_key'")
    return raw


def _prices(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise NodeInfoError("'prices' must be an object")
    prices = {}
    for name, key in PRICE_FIELDS.items():
        text = raw.get(key)
        if not isinstance(text, str) or not text.isascii() or not text.isdigit() or int(text) > MAX_WEI:
            raise NodeInfoError(f"'prices.{key}' must be a decimal string of wei")
        prices[name] = int(text)
    return prices


def _policy(raw: Any, declared: Declared) -> tuple[str | None, str]:
    if raw is None:
        return declared.jurisdiction, declared.trust_tier
    if not isinstance(raw, dict):
        raise NodeInfoError("'policy' must be an object")
    jurisdiction = raw.get("jurisdiction", declared.jurisdiction)
    if jurisdiction is not None and code_problem(jurisdiction) is not None:
        raise NodeInfoError(f"'policy.jurisdiction' {code_problem(jurisdiction)}")
    tier = raw.get("trust_tier", declared.trust_tier)
    if tier not in TRUST_TIERS:
        raise NodeInfoError(f"'policy.trust_tier' must be one of {', '.join(TRUST_TIERS)}")
    return jurisdiction, tier


def _evidence(raw: Any, declared: Declared) -> tuple[str, bool]:
    if raw is None:
        return declared.evidence_type, declared.evidence_type != NO_TEE
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str) or not raw["type"]:
        raise NodeInfoError("'evidence' must be an object with a 'type'")
    if not isinstance(raw.get("trusted"), bool):
        raise NodeInfoError("'evidence.trusted' must be true or false")
    return raw["type"], raw["trusted"] and raw["type"] != NO_TEE


def parse_node_info(doc: Any, declared: Declared) -> NodeInfo:
    """The router's view of a node from its `GET /v1/node` document; raises NodeInfoError naming the field."""
    if not isinstance(doc, dict):
        raise NodeInfoError("the document must be a JSON object")
    public_key = _public_key(doc)
    jurisdiction, tier = _policy(doc.get("policy"), declared)
    evidence_type, trusted = _evidence(doc.get("evidence"), declared)
    offer = Offer(evidence_type=evidence_type, trusted=trusted, jurisdiction=jurisdiction,
                  price_wei=_prices(doc.get("prices")))
    return NodeInfo(public_key, key_id_for(public_key), _text(doc, "boot_id"), offer, tier)
