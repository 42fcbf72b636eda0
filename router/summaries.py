"""Reading a node's prefix summaries: checking that the node signed one, and testing a request's prefixes in it.

A summary (`GET /v1/cache/summary?model=ID`, with the router's key) is a Bloom filter of keyed entries, one per
prefix where the node holds a resume point for one of this router's callers (cache/summary.py has the
construction and the threat model). Only the router can test it: the entry key comes from the router's key at
that node, the caller and the summary's epoch. The router keeps only the filter and its epoch, never a prompt:
the forms it tests are digests computed from the request in hand and dropped with it.

A summary is used only if the node's current key signed it for its current boot: a summary replayed from
another node or an earlier start, or altered on the way, is refused, and the provider is then scored cold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cache.summary import (
    BloomFilter,
    SummaryError,
    chat_prefix_forms,
    completion_prefix_form,
    prefix_entry,
    summary_key,
)
from router.node_info import NodeInfo

SUMMARY_OBJECT = "cache.summary"
SUMMARY_FIELDS = ("object", "model", "epoch", "epoch_s", "bloom", "entries", "boot_id", "key_id", "signature")
SIGNATURE_BYTES = 64
MAX_FORMS = 64
"""The deepest prefixes of a chat that are tested. A request that continues a conversation a node holds matches
near its end, and a chat of 20,000 messages would otherwise cost 20,000 HMACs per provider on the event loop."""


def signed_payload(doc: dict[str, Any]) -> bytes:
    """The bytes a summary's signature covers: the canonical JSON (sorted keys, no spaces) of every other field.
    For a summary's members (ASCII strings, integers, one nested object) this is RFC 8785's form, which the
    node's signer writes."""
    return json.dumps({key: value for key, value in doc.items() if key != "signature"}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class VerifiedSummary:
    """A summary whose signature, key, boot and model were checked."""

    model: str
    epoch: int
    bloom: BloomFilter
    entries: int


def _natural(doc: dict[str, Any], name: str) -> int:
    value = doc[name]
    if type(value) is not int or value < 0:
        raise SummaryError(f"'{name}' must be a non-negative integer")
    return value


def verify_summary(doc: Any, node: NodeInfo, model: str) -> VerifiedSummary:
    """The summary in `doc` if `node`'s key signed it for `model` in the node's current boot; raises SummaryError
    naming what does not hold."""
    if not isinstance(doc, dict):
        raise SummaryError("a summary is a JSON object")
    missing = [name for name in SUMMARY_FIELDS if name not in doc]
    if missing:
        raise SummaryError(f"the summary lacks {', '.join(missing)}")
    if doc["object"] != SUMMARY_OBJECT or doc["model"] != model:
        raise SummaryError(f"not a summary of model {model!r}")
    if doc["boot_id"] != node.boot_id or doc["key_id"] != node.key_id:
        raise SummaryError("the summary names another boot or key than the node's GET /v1/node")
    signature_hex = doc["signature"]
    try:
        signature = bytes.fromhex(signature_hex) if isinstance(signature_hex, str) else b""
    except ValueError:
        signature = b""
    if len(signature) != SIGNATURE_BYTES:
        raise SummaryError(f"'signature' must be {2 * SIGNATURE_BYTES} hex characters")
    try:
        Ed25519PublicKey.from_public_bytes(node.public_key).verify(signature, signed_payload(doc))
    except InvalidSignature as exc:
        raise SummaryError("the summary's signature does not verify under the node's key") from exc
    _natural(doc, "epoch_s")
    return VerifiedSummary(model, _natural(doc, "epoch"), BloomFilter.from_json(doc["bloom"]),
                           _natural(doc, "entries"))


@dataclass(frozen=True, slots=True)
class WarmView:
    """One provider's summary as one caller's requests test it."""

    summary: VerifiedSummary
    router_key: str = field(repr=False)
    """The router's key at that provider: the secret the entries are keyed under."""
    caller: str

    def depth(self, forms: Sequence[bytes]) -> int:
        """How deep into the request's prefix forms the summary holds: `k` when `forms[k - 1]` is the deepest form
        it holds, 0 when it holds none. Tested deepest first, so a warm
        conversation costs one HMAC; a Bloom false positive can only overstate a depth, which costs a cold
        prefill on a node that was comparable anyway."""
        if not forms:
            return 0
        key = summary_key(self.router_key, self.caller, self.summary.epoch)
        for depth in range(len(forms), 0, -1):
            if prefix_entry(key, forms[depth - 1]) in self.summary.bloom:
                return depth
        return 0


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message


def request_prefix_forms(body: dict[str, Any], chat: bool) -> list[bytes]:
    """The prefix forms of a request, shortest first: a chat's `[:n - MAX_FORMS + 1]`, ..., `[:n]`, or a text
    completion's whole prompt. Empty when the body has no form the node would have summarised (the node refuses
    it anyway)."""
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and all(_is_message(message) for message in messages):
            return chat_prefix_forms(messages)[-MAX_FORMS:]
        return []
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(type(token) is int for token in prompt)):
        return [completion_prefix_form(prompt)]
    return []
