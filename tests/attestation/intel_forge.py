"""A made-up Intel PCK hierarchy (root CA -> platform CA -> PCK) and TDX v4 quotes signed through it."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from amd_forge import REPORT_DATA, certificate, pem
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

INTEL_QE_VENDOR = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
MRTD = bytes(range(48, 96))
QE_AUTH_DATA = bytes(range(32))
ROOT_NAME = "Intel SGX Root CA"


@dataclass(frozen=True)
class IntelPki:
    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    platform_key: ec.EllipticCurvePrivateKey
    platform: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate

    @property
    def chain_pem(self) -> bytes:
        return pem(self.pck, self.platform, self.root)


def make_intel_pki() -> IntelPki:
    root_key, platform_key, pck_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    root = certificate(ROOT_NAME, ROOT_NAME, root_key.public_key(), root_key)
    platform = certificate("Intel SGX PCK Platform CA", ROOT_NAME, platform_key.public_key(), root_key)
    pck = certificate("Intel SGX PCK Certificate", "Intel SGX PCK Platform CA", pck_key.public_key(), platform_key)
    return IntelPki(root_key, root, platform_key, platform, pck_key, pck)


def raw_signature(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """r || s, 32 bytes each, big-endian: the quote's signature encoding."""
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def point(key: ec.EllipticCurvePrivateKey) -> bytes:
    numbers = key.public_key().public_numbers()
    return numbers.x.to_bytes(32, "big") + numbers.y.to_bytes(32, "big")


def tdx_quote(
    pki: IntelPki,
    report_data: bytes = REPORT_DATA,
    *,
    attestation_key: ec.EllipticCurvePrivateKey | None = None,
    mrtd: bytes = MRTD,
    td_attributes: int = 0,
    version: int = 4,
    qe_report_data: bytes | None = None,
    qe_signing_key: ec.EllipticCurvePrivateKey | None = None,
    chain_pem: bytes | None = None,
    trailing: bytes = b"",
) -> bytes:
    """A signed v4 quote; the keyword arguments break one link each when given."""
    attestation_key = attestation_key or ec.generate_private_key(ec.SECP256R1())
    header = struct.pack("<HHI4s16s20s", version, 2, 0x81, bytes(4), INTEL_QE_VENDOR, bytes(20))
    body = bytearray(584)
    body[0x078:0x080] = td_attributes.to_bytes(8, "little")
    body[0x088:0x0B8] = mrtd
    body[0x208:0x248] = report_data
    signed = header + bytes(body)
    key_point = point(attestation_key)
    qe_report = bytearray(384)
    binding = hashlib.sha256(key_point + QE_AUTH_DATA).digest() + bytes(32)
    qe_report[0x140:0x180] = binding if qe_report_data is None else qe_report_data
    chain = pki.chain_pem if chain_pem is None else chain_pem
    qe_certification = (
        bytes(qe_report)
        + raw_signature(qe_signing_key or pki.pck_key, bytes(qe_report))
        + struct.pack("<H", len(QE_AUTH_DATA)) + QE_AUTH_DATA
        + struct.pack("<HI", 5, len(chain)) + chain
    )
    signature_data = (
        raw_signature(attestation_key, signed) + key_point + struct.pack("<HI", 6, len(qe_certification))
        + qe_certification
    )
    return signed + struct.pack("<I", len(signature_data)) + signature_data + trailing
