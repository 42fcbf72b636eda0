"""The node's Ed25519 signing key: created in memory at boot, never written anywhere.

A fresh key per boot means a stolen disk yields no key, and every ledger segment is signed by
exactly one key. Auditors learn which public key to trust from the attestation evidence that binds
it (and from the segment header, which only names it); `verify_signature` is what they call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from metering.canonical import canonical_json

SIGNATURE_FIELD = "signature"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
KEY_ID_HEX_CHARS = 16


class SignatureInvalid(Exception):
    """A signature does not verify, or the key or signature is not well formed."""


def key_id_for(public_key: bytes) -> str:
    """Short name of a public key: the first 16 hex characters of SHA-256 of its 32 raw bytes."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureInvalid(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:KEY_ID_HEX_CHARS]


def public_key_from_hex(public_key_hex: str) -> bytes:
    """Decode a public key given as 64 hex characters (what `NodeSigner.public_key_hex` prints)."""
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError as exc:
        raise SignatureInvalid(
            f"public key must be {2 * PUBLIC_KEY_BYTES} hex characters, got {public_key_hex!r}"
        ) from exc
    key_id_for(raw)  # length check with the one error message
    return raw


class NodeSigner:
    """Holds the node's private key; signs metering data and nothing else."""

    __slots__ = ("_private_key", "public_key", "public_key_hex", "key_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_key_hex: str = self.public_key.hex()
        self.key_id: str = key_id_for(self.public_key)

    @classmethod
    def generate(cls) -> NodeSigner:
        """A new random key; what the node does at every start."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeSigner:
        """A key from a 32-byte RFC 8032 seed; for tests and vectors, never for a serving node."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data`."""
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"NodeSigner(key_id={self.key_id!r})"


def verify_signature(public_key_hex: str, data: bytes, signature: bytes) -> None:
    """Raise `SignatureInvalid` unless `signature` is the Ed25519 signature of `data`."""
    raw = public_key_from_hex(public_key_hex)
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureInvalid(f"an Ed25519 signature is {SIGNATURE_BYTES} bytes, got {len(signature)}")
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(signature, data)
    except InvalidSignature as exc:
        raise SignatureInvalid(
            f"signature does not verify under public key {key_id_for(raw)}; the data or the "
            "signature was changed, or another key signed it"
        ) from exc


def signature_from_hex(signature_hex: object) -> bytes:
    """Decode a signature carried as 128 hex characters in JSON."""
    if not isinstance(signature_hex, str) or len(signature_hex) != 2 * SIGNATURE_BYTES:
        raise SignatureInvalid(f"signature must be {2 * SIGNATURE_BYTES} hex characters")
    try:
        return bytes.fromhex(signature_hex)
    except ValueError as exc:
        raise SignatureInvalid("signature is not hex") from exc


def signed_payload(obj: Mapping[str, Any]) -> bytes:
    """The bytes a signed JSON object's signature covers: the canonical JSON of every other member.

    Records, segment headers and tree heads all follow this one rule, and their member sets differ,
    so a signature over one kind of object can never be passed off as a signature over another.
    """
    return canonical_json({key: value for key, value in obj.items() if key != SIGNATURE_FIELD})


def verify_signed_object(public_key_hex: str, obj: Mapping[str, Any]) -> None:
    """Raise `SignatureInvalid` unless `obj["signature"]` signs `signed_payload(obj)` under the key."""
    signature = signature_from_hex(obj.get(SIGNATURE_FIELD))
    verify_signature(public_key_hex, signed_payload(obj), signature)
