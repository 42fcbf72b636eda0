"""ECDSA P-256 SHA-256 signatures as Intel encodes them outside X.509: r || s, 32 bytes each, big-endian.

Quotes, quoting enclave reports, TCB info and QE identity all carry their signatures this way, and every one of them
is checked here, so a raw signature is never compared against a key in two different ways.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

RAW_SIGNATURE_BYTES = 64


def verifies(key: ec.EllipticCurvePublicKey, raw_signature: bytes, data: bytes) -> bool:
    """Whether `raw_signature` (r || s) is `key`'s ECDSA SHA-256 signature of `data`."""
    if len(raw_signature) != RAW_SIGNATURE_BYTES:
        return False
    r, s = int.from_bytes(raw_signature[:32], "big"), int.from_bytes(raw_signature[32:], "big")
    try:
        key.verify(encode_dss_signature(r, s), data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True
