"""A made-up AMD key hierarchy (ARK -> ASK -> VCEK) and SEV-SNP reports signed by it, for tests.

Certificates are shaped like AMD KDS's: RSASSA-PSS SHA-384 salt 48 links, a P-384 VCEK carrying
the TCB and HWID extensions. RSA keys are 2048-bit (real ones are 4096) so a session builds fast.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from attestation.binding import BoundIdentity, report_data_for
from attestation.evidence import Evidence
from attestation.snp_report import ASK_GUID, ENTRY, VCEK_GUID

NOW = datetime(2026, 12, 1, tzinfo=UTC)
NODE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32))).public_key().public_bytes(
    serialization.Encoding.Raw, serialization.PublicFormat.Raw
)
OTHER_NODE_KEY = bytes(range(1, 33))
NONCE = bytes(range(100, 132))
OLD_NONCE = bytes(range(200, 232))
BOOT_ID = "boot-a"
REPORT_DATA = report_data_for(NODE_KEY, NONCE)
TLS_SPKI = bytes(range(140, 172))
CODE_DIGEST = bytes(range(172, 204))
MODEL_DIGEST = bytes(range(204, 236))
BOUND = BoundIdentity.of(tls_spki_sha256=TLS_SPKI, code_digest=CODE_DIGEST, model_digests=[("default", MODEL_DIGEST)])
REPORT_DATA_V2 = report_data_for(NODE_KEY, NONCE, BOUND)

MILAN_TCB = bytes([3, 0, 0, 0, 0, 0, 8, 209])  # bl=3 tee=0 snp=8 ucode=209 (>= 128: a two-byte DER INTEGER)
CHIP_ID = bytes(range(64, 128))
MEASUREMENT = bytes(range(48))
POLICY = 0x30000  # SMT allowed, reserved bit 17 set, debug off
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
SPL_ARCS = {"bl": 1, "tee": 2, "snp": 3, "spl4": 4, "spl5": 5, "spl6": 6, "spl7": 7, "ucode": 8}
MILAN_BYTES = {"bl": 0, "tee": 1, "spl4": 2, "spl5": 3, "spl6": 4, "spl7": 5, "snp": 6, "ucode": 7}


@dataclass(frozen=True)
class AmdPki:
    product: str
    ark_key: rsa.RSAPrivateKey
    ark: x509.Certificate
    ask_key: rsa.RSAPrivateKey
    ask: x509.Certificate


def name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def certificate(
    subject: str,
    issuer: str,
    public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey,
    signing_key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
    extensions: Mapping[str, bytes] | None = None,
    not_after: datetime = NOW + timedelta(days=365),
) -> x509.Certificate:
    """A certificate signed the way its vendor signs: PSS SHA-384 for RSA keys, ECDSA SHA-256 for EC keys."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=30))
        .not_valid_after(not_after)
    )
    for oid, value in (extensions or {}).items():
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value), critical=False)
    if isinstance(signing_key, rsa.RSAPrivateKey):
        return builder.sign(signing_key, hashes.SHA384(), rsa_padding=PSS)
    return builder.sign(signing_key, hashes.SHA256())


def make_amd_pki(product: str = "Milan") -> AmdPki:
    ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ark = certificate(f"ARK-{product}", f"ARK-{product}", ark_key.public_key(), ark_key)
    ask = certificate(f"SEV-{product}", f"ARK-{product}", ask_key.public_key(), ark_key)
    return AmdPki(product=product, ark_key=ark_key, ark=ark, ask_key=ask_key, ask=ask)


def der_integer(value: int) -> bytes:
    content = value.to_bytes((value.bit_length() + 8) // 8, "big")  # a leading zero keeps it positive
    return bytes([0x02, len(content)]) + content


def vcek_extensions(tcb: bytes = MILAN_TCB, hwid: bytes | None = CHIP_ID) -> dict[str, bytes]:
    extensions = {"1.3.6.1.4.1.3704.1.2": b"\x16\x08Milan-B0"}
    for component, arc in SPL_ARCS.items():
        extensions[f"1.3.6.1.4.1.3704.1.3.{arc}"] = der_integer(tcb[MILAN_BYTES[component]])
    if hwid is not None:
        extensions["1.3.6.1.4.1.3704.1.4"] = hwid
    return extensions


def make_vcek(
    pki: AmdPki, tcb: bytes = MILAN_TCB, hwid: bytes | None = CHIP_ID, not_after: datetime = NOW + timedelta(days=365)
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = certificate("SEV-VCEK", f"SEV-{pki.product}", key.public_key(), pki.ask_key, vcek_extensions(tcb, hwid),
                       not_after)
    return key, vcek


def snp_report(
    key: ec.EllipticCurvePrivateKey,
    report_data: bytes = REPORT_DATA,
    *,
    version: int = 3,
    policy: int = POLICY,
    signer_info: int = 0,
    current_tcb: bytes = MILAN_TCB,
    reported_tcb: bytes = MILAN_TCB,
    committed_tcb: bytes | None = None,
    chip_id: bytes = CHIP_ID,
    measurement: bytes = MEASUREMENT,
    cpuid_family: int = 0x19,
    signature_byte_order: Literal["little", "big"] = "little",
) -> bytes:
    """A signed 0x4A0-byte report; `signature_byte_order="big"` stores R and S the wrong way round."""
    report = bytearray(0x4A0)
    struct.pack_into("<IIQ", report, 0x000, version, 1, policy)
    struct.pack_into("<I", report, 0x034, 1)
    report[0x038:0x040] = current_tcb
    struct.pack_into("<I", report, 0x048, signer_info)
    report[0x050:0x090] = report_data
    report[0x090:0x0C0] = measurement
    report[0x180:0x188] = reported_tcb
    if version >= 3:
        report[0x188:0x18B] = bytes([cpuid_family, 0x01, 0x01])
    report[0x1A0:0x1E0] = chip_id
    report[0x1E0:0x1E8] = current_tcb if committed_tcb is None else committed_tcb
    r, s = decode_dss_signature(key.sign(bytes(report[:0x2A0]), ec.ECDSA(hashes.SHA384())))
    report[0x2A0:0x2E8] = r.to_bytes(72, signature_byte_order)
    report[0x2E8:0x330] = s.to_bytes(72, signature_byte_order)
    return bytes(report)


def cert_table(certs: Mapping[uuid.UUID, bytes]) -> bytes:
    """A certificate table as a host writes it: entries, the all-zero end entry, then the data."""
    offset = (len(certs) + 1) * ENTRY.size
    entries, data = [], []
    for guid, cert in certs.items():
        entries.append(ENTRY.pack(guid.bytes, offset, len(cert)))
        data.append(cert)
        offset += len(cert)
    return b"".join(entries) + bytes(ENTRY.size) + b"".join(data)


def vcek_and_ask(pki: AmdPki, vcek: x509.Certificate) -> bytes:
    """The certificate table a host supplies: the VCEK and the ASK, DER."""
    return cert_table({VCEK_GUID: der(vcek), ASK_GUID: der(pki.ask)})


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def pem(*certs: x509.Certificate) -> bytes:
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)


def snp_evidence(
    report: bytes, aux: bytes, public_key: bytes = NODE_KEY, nonce: bytes = NONCE, bound: BoundIdentity | None = None
) -> Evidence:
    return Evidence(evidence_type="sev-snp", source="configfs-tsm", report=report, aux=aux, gpu=None,
                    public_key=public_key, boot_id=BOOT_ID, nonce=nonce, bound=bound)
