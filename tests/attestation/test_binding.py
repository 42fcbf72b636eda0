"""Key binding: the exact report_data for a key and nonce (v1), with the bound values too (v2), and refusals."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest

from attestation.binding import (
    BINDING_DOMAIN,
    BINDING_DOMAIN_V2,
    BoundIdentity,
    ModelDigest,
    binding_digest,
    binding_input,
    report_data_for,
)
from attestation.errors import MalformedEvidence

KEY, NONCE = bytes(range(32)), bytes(range(32, 64))
SPKI, CODE, DIGEST_A, DIGEST_B = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32, b"\x44" * 32
BOUND = BoundIdentity.of(tls_spki_sha256=SPKI, code_digest=CODE, model_digests=[("bb", DIGEST_B), ("a", DIGEST_A)])


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


def test_the_v2_domain_string_is_fixed() -> None:
    assert BINDING_DOMAIN_V2 == b"tenzro-attestation-v2\x00"


def test_the_v2_input_is_the_documented_layout() -> None:
    assert binding_input(KEY, NONCE, BOUND) == (
        b"tenzro-attestation-v2\x00" + KEY + b"\x01" + SPKI + CODE + b"\x00\x02"
        + b"\x00\x01a" + DIGEST_A + b"\x00\x02bb" + DIGEST_B + NONCE
    )
    # sha256sum of that input, built with printf outside Python's binding code
    assert report_data_for(KEY, NONCE, BOUND).hex() == (
        "9a2d377af79789bd1cf5522781594f55d99f728a99256255641716cdcebd3c9f" + "00" * 32
    )
    assert binding_digest(KEY, NONCE, BOUND) == report_data_for(KEY, NONCE, BOUND)[:32]


def test_without_tls_the_input_carries_a_zero_presence_byte() -> None:
    bound = BoundIdentity.of(tls_spki_sha256=None, code_digest=bytes(32), model_digests=[("default", bytes(32))])
    assert binding_input(bytes(32), bytes(32), bound) == (
        BINDING_DOMAIN_V2 + bytes(32) + b"\x00" + bytes(32) + b"\x00\x01\x00\x07default" + bytes(32) + bytes(32)
    )
    assert report_data_for(bytes(32), bytes(32), bound)[:32].hex() == (
        "4b9e789bcbc6a34f4b6b34d8cf8a0e7cf672cc892838cbbc88f2f7785650f973"
    )


def parse_v2(data: bytes) -> tuple[bytes, bytes | None, bytes, list[tuple[str, bytes]], bytes]:
    """Read a v2 input back into (key, tls, code, models, nonce); every byte must be consumed."""
    assert data.startswith(BINDING_DOMAIN_V2)
    at = len(BINDING_DOMAIN_V2)

    def take(size: int) -> bytes:
        nonlocal at
        assert at + size <= len(data)
        at += size
        return data[at - size:at]

    key = take(32)
    tls = take(32) if take(1) == b"\x01" else None
    code = take(32)
    (count,) = struct.unpack(">H", take(2))
    models = []
    for _ in range(count):
        (length,) = struct.unpack(">H", take(2))
        models.append((take(length).decode("ascii"), take(32)))
    nonce = take(32)
    assert at == len(data)
    return key, tls, code, models, nonce


@pytest.mark.parametrize(
    ("tls", "models"),
    [
        (SPKI, [("a", DIGEST_A), ("bb", DIGEST_B)]),
        (None, [("a", DIGEST_A), ("bb", DIGEST_B)]),
        (bytes(32), [("a", DIGEST_A)]),
        (SPKI, [("a" + "b" * 31, DIGEST_A)]),  # an id as long as a digest: the length prefix tells them apart
        (SPKI, [("x" * 256, DIGEST_A), ("y", DIGEST_B), ("z", DIGEST_A)]),
    ],
)
def test_an_input_parses_back_to_exactly_its_values(tls: bytes | None, models: list[tuple[str, bytes]]) -> None:
    bound = BoundIdentity.of(tls_spki_sha256=tls, code_digest=CODE, model_digests=models)
    assert parse_v2(binding_input(KEY, NONCE, bound)) == (KEY, tls, CODE, models, NONCE)


def test_values_that_concatenate_alike_bind_differently() -> None:
    def data(tls: bytes | None, code: bytes, models: list[tuple[str, bytes]]) -> bytes:
        bound = BoundIdentity.of(tls_spki_sha256=tls, code_digest=code, model_digests=models)
        return report_data_for(KEY, NONCE, bound)

    # Plain concatenation gives both KEY || CODE || b"x" * 32 || b"m" || DIGEST_A: the presence byte and
    # the length prefixes tell "no TLS, a model named x...xm" from "TLS, code x...x, a model named m".
    printable = b"x" * 32
    assert data(None, CODE, [("x" * 32 + "m", DIGEST_A)]) != data(CODE, printable, [("m", DIGEST_A)])
    assert data(None, CODE, [("a", DIGEST_A)]) != data(bytes(32), CODE, [("a", DIGEST_A)])
    assert data(SPKI, CODE, [("a", DIGEST_A), ("b", DIGEST_B)]) != data(SPKI, CODE, [("a", DIGEST_B), ("b", DIGEST_A)])
    assert report_data_for(KEY, NONCE) != report_data_for(KEY, NONCE, BOUND)


def test_the_model_order_given_does_not_matter() -> None:
    reordered = BoundIdentity.of(tls_spki_sha256=SPKI, code_digest=CODE,
                                 model_digests=[("a", DIGEST_A), ("bb", DIGEST_B)])
    assert reordered == BOUND
    assert [model.model_id for model in BOUND.models] == ["a", "bb"]


def test_describe_names_every_value() -> None:
    assert BOUND.describe() == (
        f"TLS SPKI SHA-256 {SPKI.hex()}, code {CODE.hex()}, models [a={DIGEST_A.hex()}, bb={DIGEST_B.hex()}]"
    )
    bound = BoundIdentity.of(tls_spki_sha256=None, code_digest=CODE, model_digests=[("a", DIGEST_A)])
    assert bound.describe() == f"TLS SPKI SHA-256 none (plain HTTP), code {CODE.hex()}, models [a={DIGEST_A.hex()}]"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls_spki_sha256": SPKI.hex()}, "tls_spki_sha256 must be a 32-byte SHA-256 digest, got a str"),
        ({"tls_spki_sha256": bytes(48)}, "tls_spki_sha256 must be a 32-byte SHA-256 digest, got 48 bytes"),
        ({"code_digest": bytes(31)}, "code_digest must be a 32-byte SHA-256 digest, got 31 bytes"),
        ({"model_digests": []}, "a binding names 1 to 65535 models, got 0"),
        ({"model_digests": [("a", DIGEST_A), ("a", DIGEST_B)]},
         "models must be in ascending order of id, each id once; got ids ['a', 'a']"),
        ({"model_digests": [("a", bytes(16))]}, "model 'a' digest must be a 32-byte SHA-256 digest, got 16 bytes"),
        ({"model_digests": [("", DIGEST_A)]}, "model id must be 1-256 printable ASCII characters, got ''"),
        ({"model_digests": [("x" * 257, DIGEST_A)]}, "model id must be 1-256 printable ASCII characters, got 'xxx"),
        ({"model_digests": [("modèle", DIGEST_A)]}, "model id must be 1-256 printable ASCII characters, got 'modèle'"),
        ({"model_digests": [("a\nb", DIGEST_A)]}, "model id must be 1-256 printable ASCII characters, got 'a\\nb'"),
    ],
)
def test_malformed_bound_values_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(MalformedEvidence) as refused:
        BoundIdentity.of(**{"tls_spki_sha256": SPKI, "code_digest": CODE, "model_digests": [("a", DIGEST_A)],
                            **values})
    assert str(refused.value).startswith(message)


def test_models_out_of_canonical_order_are_refused() -> None:
    with pytest.raises(MalformedEvidence) as refused:
        BoundIdentity(tls_spki_sha256=SPKI, code_digest=CODE,
                      models=(ModelDigest("bb", DIGEST_B), ModelDigest("a", DIGEST_A)))
    assert str(refused.value) == "models must be in ascending order of id, each id once; got ids ['bb', 'a']"
