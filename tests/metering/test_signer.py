"""Ed25519 signing: RFC 8032 test vectors, key ids, and typed verification failures."""

from __future__ import annotations

import hashlib

import pytest

from metering.signer import (
    NodeSigner,
    SignatureInvalid,
    key_id_for,
    public_key_from_hex,
    signed_payload,
    verify_signature,
    verify_signed_object,
)

# RFC 8032 section 7.1, TEST 1 and TEST 2.
RFC8032_VECTORS = [
    (
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
    ),
    (
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
    ),
]


@pytest.mark.parametrize(("seed", "public", "message", "signature"), RFC8032_VECTORS)
def test_rfc8032_vectors(seed: str, public: str, message: str, signature: str) -> None:
    signer = NodeSigner.from_seed(bytes.fromhex(seed))
    assert signer.public_key_hex == public
    assert signer.sign(bytes.fromhex(message)).hex() == signature
    verify_signature(public, bytes.fromhex(message), bytes.fromhex(signature))


def test_key_id_is_first_16_hex_of_sha256_of_raw_public_key() -> None:
    signer = NodeSigner.from_seed(bytes.fromhex(RFC8032_VECTORS[0][0]))
    assert signer.key_id == hashlib.sha256(bytes.fromhex(RFC8032_VECTORS[0][1])).hexdigest()[:16]
    assert signer.key_id == "21fe31dfa154a261"
    assert repr(signer) == "NodeSigner(key_id='21fe31dfa154a261')"


def test_generated_keys_differ() -> None:
    assert NodeSigner.generate().public_key != NodeSigner.generate().public_key


def test_changed_data_fails_with_typed_error() -> None:
    seed, public, _, _ = RFC8032_VECTORS[1]
    signature = NodeSigner.from_seed(bytes.fromhex(seed)).sign(b"usage")
    with pytest.raises(SignatureInvalid, match="does not verify under public key"):
        verify_signature(public, b"usagE", signature)


def test_signature_of_another_key_fails() -> None:
    signature = NodeSigner.from_seed(bytes.fromhex(RFC8032_VECTORS[0][0])).sign(b"usage")
    with pytest.raises(SignatureInvalid):
        verify_signature(RFC8032_VECTORS[1][1], b"usage", signature)


@pytest.mark.parametrize(
    ("public", "signature", "message"),
    [
        ("zz" * 32, bytes(64), "64 hex characters"),
        ("00" * 31, bytes(64), "is 32 bytes, got 31"),
        (RFC8032_VECTORS[0][1], bytes(63), "signature is 64 bytes, got 63"),
    ],
)
def test_malformed_inputs_raise_signature_invalid(public: str, signature: bytes, message: str) -> None:
    with pytest.raises(SignatureInvalid, match=message):
        verify_signature(public, b"x", signature)


def test_public_key_from_hex() -> None:
    assert public_key_from_hex(RFC8032_VECTORS[0][1]) == bytes.fromhex(RFC8032_VECTORS[0][1])
    with pytest.raises(SignatureInvalid):
        key_id_for(b"short")


def test_seed_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        NodeSigner.from_seed(bytes(31))


def test_signed_object_covers_every_member_but_the_signature() -> None:
    signer = NodeSigner.from_seed(bytes.fromhex(RFC8032_VECTORS[0][0]))
    body = {"size": 2, "name": "x"}
    assert signed_payload({**body, "signature": "ignored"}) == b'{"name":"x","size":2}'
    signed = {**body, "signature": signer.sign(signed_payload(body)).hex()}
    verify_signed_object(signer.public_key_hex, signed)
    with pytest.raises(SignatureInvalid):
        verify_signed_object(signer.public_key_hex, {**signed, "size": 3})
    with pytest.raises(SignatureInvalid, match="128 hex characters"):
        verify_signed_object(signer.public_key_hex, body)
