"""Key binding: the 64 bytes of report_data that tie a TEE report to the node key and a verifier nonce.

    report_data[0:32]  = SHA-256(BINDING_DOMAIN || public_key (32 raw Ed25519 bytes) || nonce (32 bytes))
    report_data[32:64] = zero

The hardware signs report_data, so a report whose report_data is this value says "the guest that
holds this public key answered this nonce". The domain string keeps the digest from ever equalling a
hash the node computes for another purpose; the fixed lengths leave no two (key, nonce) pairs with
the same input. The first 32 bytes (the binding digest) are also the nonce of GPU attestation
reports, so those are bound to the same key and nonce.
"""

from __future__ import annotations

import hashlib

from attestation.errors import MalformedEvidence

BINDING_DOMAIN = b"tenzro-attestation-v1\0"
PUBLIC_KEY_BYTES = 32
NONCE_BYTES = 32
REPORT_DATA_BYTES = 64
"""Both SEV-SNP (REPORT_DATA) and TDX (REPORTDATA) carry exactly 64 bytes of guest data."""


def require_public_key(public_key: bytes) -> bytes:
    """The node's raw Ed25519 public key, checked for length."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise MalformedEvidence(
            f"public key must be the {PUBLIC_KEY_BYTES} raw bytes of an Ed25519 key, got {_size(public_key)}"
        )
    return public_key


def require_nonce(nonce: bytes) -> bytes:
    """A verifier nonce, checked for length: exactly 32 bytes, so no shorter guessable nonce passes."""
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise MalformedEvidence(f"nonce must be exactly {NONCE_BYTES} bytes, got {_size(nonce)}")
    return nonce


def binding_digest(public_key: bytes, nonce: bytes) -> bytes:
    """SHA-256(BINDING_DOMAIN || public_key || nonce): 32 bytes."""
    return hashlib.sha256(BINDING_DOMAIN + require_public_key(public_key) + require_nonce(nonce)).digest()


def report_data_for(public_key: bytes, nonce: bytes) -> bytes:
    """The 64 bytes a TEE report must carry as report_data for this key and nonce."""
    return binding_digest(public_key, nonce) + bytes(REPORT_DATA_BYTES - 32)


def _size(value: object) -> str:
    return f"{len(value)} bytes" if isinstance(value, bytes) else f"a {type(value).__name__}"
