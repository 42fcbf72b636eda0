"""Key binding: the exact report_data for a key and nonce, and the lengths it refuses."""

from __future__ import annotations

import hashlib

import pytest

from attestation.binding import BINDING_DOMAIN, binding_digest, report_data_for
from attestation.errors import MalformedEvidence


def test_the_domain_string_is_fixed() -> None:
    assert BINDING_DOMAIN == b"tenzro-attestation-v1\x00"


def test_report_data_is_the_domain_separated_digest_then_zeros() -> None:
    # sha256sum of printf 'tenzro-attestation-v1\0' followed by 64 zero bytes
    assert report_data_for(bytes(32), bytes(32)).hex() == (
        "633965047adb93fadf809538b24650800f15372131f0418e6792861d9cd74d27" + "00" * 32
    )
    key, nonce = bytes(range(32)), bytes(range(32, 64))
    assert report_data_for(key, nonce) == hashlib.sha256(BINDING_DOMAIN + key + nonce).digest() + bytes(32)
    assert binding_digest(key, nonce) == report_data_for(key, nonce)[:32]


def test_key_and_nonce_are_not_interchangeable() -> None:
    key, nonce = bytes(range(32)), bytes(range(32, 64))
    assert report_data_for(key, nonce) != report_data_for(nonce, key)


@pytest.mark.parametrize(
    ("key", "nonce", "message"),
    [
        (bytes(32), bytes(31), "nonce must be exactly 32 bytes, got 31 bytes"),
        (bytes(32), bytes(33), "nonce must be exactly 32 bytes, got 33 bytes"),
        (bytes(32), "00" * 32, "nonce must be exactly 32 bytes, got a str"),
        (bytes(31), bytes(32), "public key must be the 32 raw bytes of an Ed25519 key, got 31 bytes"),
        (bytes(44), bytes(32), "public key must be the 32 raw bytes of an Ed25519 key, got 44 bytes"),
    ],
)
def test_other_lengths_are_refused(key: bytes, nonce: bytes, message: str) -> None:
    with pytest.raises(MalformedEvidence) as refused:
        report_data_for(key, nonce)
    assert str(refused.value) == message
