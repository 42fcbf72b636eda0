"""A made-up AMD key hierarchy (ARK -> ASK -> VCEK, ARK -> ASVK -> VLEK), its CRLs and SEV-SNP reports, for tests.

Certificates are shaped like AMD KDS's: RSASSA-PSS SHA-384 salt 48 links, a P-384 VCEK carrying
the TCB and HWID extensions (Milan/Genoa or Turin layout), a VLEK carrying a CSP_ID instead.
`amd_name` gives AMD's real subject names; `name` (the default) only the CN. RSA keys are 2048-bit
(real ones are 4096) so a session builds fast.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
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
from attestation.snp_report import ASK_GUID, ENTRY, VCEK_GUID, VLEK_GUID

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
TURIN_TCB = bytes([1, 4, 0, 3, 0, 0, 0, 72])  # fmc=1 bl=4 tee=0 snp=3 ucode=72
CHIP_ID = bytes(range(64, 128))
TURIN_HWID = bytes(range(1, 9))  # a Turin VCEK certifies 8 bytes; its CHIP_ID is them and 56 zero bytes
CSP_ID = "Microsoft Azure"
MEASUREMENT = bytes(range(48))
POLICY = 0x30000  # SMT allowed, reserved bit 17 set, debug off
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
SPL_ARCS = {"bl": 1, "tee": 2, "snp": 3, "spl4": 4, "spl5": 5, "spl6": 6, "spl7": 7, "ucode": 8, "fmc": 9}
MILAN_BYTES = {"bl": 0, "tee": 1, "spl4": 2, "spl5": 3, "spl6": 4, "spl7": 5, "snp": 6, "ucode": 7}
TURIN_BYTES = {"fmc": 0, "bl": 1, "tee": 2, "snp": 3, "spl5": 4, "spl6": 5, "spl7": 6, "ucode": 7}
"""The real Turin VCEK (virtee/sev tests/certs_data/vcek_turin.der) has .3.5-.3.7 and FMC, and no .3.4."""
Naming = Callable[[str], x509.Name]


@dataclass(frozen=True)
class AmdPki:
    product: str
    ark_key: rsa.RSAPrivateKey
    ark: x509.Certificate
    ask_key: rsa.RSAPrivateKey
    ask: x509.Certificate
    asvk_key: rsa.RSAPrivateKey
    asvk: x509.Certificate
    naming: Naming


def name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def amd_name(common_name: str) -> x509.Name:
    """AMD KDS's subject names, attribute for attribute."""
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Engineering"),
        x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
        x509.NameAttribute(NameOID.LOCALITY_NAME, "Santa Clara"),
        x509.NameAttribute(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Advanced Micro Devices"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def certificate(
    subject: str,
    issuer: str,
    public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey,
    signing_key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
    extensions: Mapping[str, bytes] | None = None,
    not_after: datetime = NOW + timedelta(days=365),
    naming: Naming = name,
    serial_number: int | None = None,
    ca: bool = False,
) -> x509.Certificate:
    """A certificate signed the way its vendor signs: PSS SHA-384 for RSA keys, ECDSA SHA-256 for EC keys; `ca`
    marks an issuer (basic constraints cA, as AMD's and Intel's roots and intermediates carry it)."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(naming(subject))
        .issuer_name(naming(issuer))
        .public_key(public_key)
        .serial_number(serial_number or x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=30))
        .not_valid_after(not_after)
    )
    for oid, value in (extensions or {}).items():
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value), critical=False)
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    if isinstance(signing_key, rsa.RSAPrivateKey):
        return builder.sign(signing_key, hashes.SHA384(), rsa_padding=PSS)
    return builder.sign(signing_key, hashes.SHA256())


def make_amd_pki(product: str = "Milan", naming: Naming = name) -> AmdPki:
    ark_key, ask_key, asvk_key = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(3))
    ark = certificate(f"ARK-{product}", f"ARK-{product}", ark_key.public_key(), ark_key, naming=naming, ca=True)
    ask = certificate(f"SEV-{product}", f"ARK-{product}", ask_key.public_key(), ark_key, naming=naming, ca=True)
    asvk = certificate(f"SEV-VLEK-{product}", f"ARK-{product}", asvk_key.public_key(), ark_key, naming=naming, ca=True)
    return AmdPki(product=product, ark_key=ark_key, ark=ark, ask_key=ask_key, ask=ask, asvk_key=asvk_key, asvk=asvk,
                  naming=naming)


def der_integer(value: int) -> bytes:
    content = value.to_bytes((value.bit_length() + 8) // 8, "big")  # a leading zero keeps it positive
    return bytes([0x02, len(content)]) + content


def ia5(text: str) -> bytes:
    return bytes([0x16, len(text)]) + text.encode("ascii")


def vcek_extensions(
    tcb: bytes = MILAN_TCB, hwid: bytes | None = CHIP_ID, product_name: str = "Milan-B0",
    layout: Mapping[str, int] = MILAN_BYTES,
) -> dict[str, bytes]:
    """The KDS extensions: product name, each SPL of `layout` read from `tcb`, the HWID."""
    extensions = {"1.3.6.1.4.1.3704.1.2": ia5(product_name)}
    for component, index in layout.items():
        extensions[f"1.3.6.1.4.1.3704.1.3.{SPL_ARCS[component]}"] = der_integer(tcb[index])
    if hwid is not None:
        extensions["1.3.6.1.4.1.3704.1.4"] = hwid
    return extensions


def make_vcek(
    pki: AmdPki, tcb: bytes = MILAN_TCB, hwid: bytes | None = CHIP_ID, not_after: datetime = NOW + timedelta(days=365),
    serial_number: int | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = certificate("SEV-VCEK", f"SEV-{pki.product}", key.public_key(), pki.ask_key, vcek_extensions(tcb, hwid),
                       not_after, pki.naming, serial_number)
    return key, vcek


def with_serial_zero(cert: x509.Certificate, issuer_key: rsa.RSAPrivateKey) -> bytes:
    """`cert` (serial 1, RSA-PSS signed) as DER with serial 0 and signed again: AMD KDS issues every VCEK with
    serial 0, which cryptography's builder refuses to make. The one-byte serial keeps every length the same."""
    original = der(cert)
    tbs = bytearray(cert.tbs_certificate_bytes)
    serial_at = 9  # SEQUENCE header (4 bytes), [0] { INTEGER 2 } (5 bytes), then INTEGER serial
    assert tbs[serial_at : serial_at + 3] == b"\x02\x01\x01" and original.endswith(cert.signature)
    tbs[serial_at + 2] = 0
    signature = issuer_key.sign(bytes(tbs), PSS, hashes.SHA384())
    start = original.index(cert.tbs_certificate_bytes)
    body = original[: start] + bytes(tbs) + original[start + len(tbs) : -len(signature)]
    return body + signature


def make_turin_vcek(pki: AmdPki, tcb: bytes = TURIN_TCB) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A VCEK shaped like the real Turin one: product "Turin", FMC_SPL, an 8-byte HWID."""
    key = ec.generate_private_key(ec.SECP384R1())
    extensions = vcek_extensions(tcb, TURIN_HWID, "Turin", TURIN_BYTES)
    return key, certificate("SEV-VCEK", f"SEV-{pki.product}", key.public_key(), pki.ask_key, extensions,
                            naming=pki.naming)


def make_vlek(pki: AmdPki, tcb: bytes = MILAN_TCB) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A VLEK: issued by the ASVK, product without stepping, CSP_ID instead of HWID."""
    key = ec.generate_private_key(ec.SECP384R1())
    extensions = {**vcek_extensions(tcb, None, pki.product), "1.3.6.1.4.1.3704.1.5": ia5(CSP_ID)}
    return key, certificate("SEV-VLEK", f"SEV-VLEK-{pki.product}", key.public_key(), pki.asvk_key, extensions,
                            naming=pki.naming)


def make_crl(
    pki: AmdPki, revoked: Sequence[x509.Certificate] = (), *, signer: rsa.RSAPrivateKey | None = None,
    next_update: datetime = NOW + timedelta(days=7),
) -> bytes:
    """A DER CRL as AMD KDS serves it: issued by the ARK, RSASSA-PSS SHA-384, naming `revoked` by serial."""
    builder = (x509.CertificateRevocationListBuilder().issuer_name(pki.ark.subject)
               .last_update(NOW - timedelta(days=30)).next_update(next_update))
    for cert in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(NOW - timedelta(days=2))
            .build())
    crl = builder.sign(signer or pki.ark_key, hashes.SHA384(), rsa_padding=PSS)
    return crl.public_bytes(serialization.Encoding.DER)


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
    cpuid_model: int = 0x01,
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
        report[0x188:0x18B] = bytes([cpuid_family, cpuid_model, 0x01])
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


def vlek_and_asvk(pki: AmdPki, vlek: x509.Certificate) -> bytes:
    """The certificate table of a VLEK report: the VLEK, and the ASVK under the ASK GUID (as go-sev-guest reads it)."""
    return cert_table({VLEK_GUID: der(vlek), ASK_GUID: der(pki.asvk)})


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def pem(*certs: x509.Certificate) -> bytes:
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)


def snp_evidence(
    report: bytes, aux: bytes, public_key: bytes = NODE_KEY, nonce: bytes = NONCE, bound: BoundIdentity | None = None
) -> Evidence:
    return Evidence(evidence_type="sev-snp", source="configfs-tsm", report=report, aux=aux, gpu=None,
                    public_key=public_key, boot_id=BOOT_ID, nonce=nonce, bound=bound)
