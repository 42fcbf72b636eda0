"""A made-up Intel PCK hierarchy (root CA -> platform CA -> PCK, root CA -> TCB signing) with Intel's subject names,
TDX v4 and v5 quotes signed through it, and the collateral Intel PCS would serve for it (TCB info, QE identity, CRLs).

The PCK certificate carries the SGX extension (FMSPC, PCEID, TCB) and the QE report the real TD QE's identity
(MRSIGNER, ISVPRODID, ATTRIBUTES of go-tdx-guest's SPR quote), so Intel's matching rules run on them unchanged.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from amd_forge import NOW, REPORT_DATA, certificate, pem
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from attestation.collateral import Collateral

INTEL_QE_VENDOR = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
MRTD = bytes(range(48, 96))
QE_AUTH_DATA = bytes(range(32))
ROOT_NAME = "Intel SGX Root CA"
PLATFORM_CA_NAME = "Intel SGX PCK Platform CA"
TCB_SIGNING_NAME = "Intel SGX TCB Signing"
FMSPC = bytes.fromhex("50806f000000")
PCEID = bytes(2)
PCK_TCB = (3, 3, 2, 2, 2, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0)  # the SGX TCB components of go-tdx-guest's SPR PCK
PCESVN = 11
TEE_TCB_SVN = bytes([3, 0, 5]) + bytes(13)
QE_MRSIGNER = bytes.fromhex("dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5")
QE_ATTRIBUTES = bytes.fromhex("1500000000000000e700000000000000")
QE_ISVPRODID, QE_ISVSVN = 2, 4
SGX_OID = "1.2.840.113741.1.13.1"


@dataclass(frozen=True)
class IntelPki:
    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    platform_key: ec.EllipticCurvePrivateKey
    platform: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate
    tcb_signing_key: ec.EllipticCurvePrivateKey
    tcb_signing: x509.Certificate

    @property
    def chain_pem(self) -> bytes:
        return pem(self.pck, self.platform, self.root)


def make_intel_pki() -> IntelPki:
    root_key, platform_key, pck_key, signing_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    root = certificate(ROOT_NAME, ROOT_NAME, root_key.public_key(), root_key, ca=True)
    platform = certificate(PLATFORM_CA_NAME, ROOT_NAME, platform_key.public_key(), root_key, ca=True)
    pck = certificate("Intel SGX PCK Certificate", PLATFORM_CA_NAME, pck_key.public_key(), platform_key,
                      {SGX_OID: sgx_extension()})
    tcb_signing = certificate(TCB_SIGNING_NAME, ROOT_NAME, signing_key.public_key(), root_key)
    return IntelPki(root_key, root, platform_key, platform, pck_key, pck, signing_key, tcb_signing)


def _der(tag: int, content: bytes) -> bytes:
    size = len(content)
    length = bytes([size]) if size < 0x80 else bytes([0x82]) + size.to_bytes(2, "big")
    return bytes([tag]) + length + content


def _oid(dotted: str) -> bytes:
    arcs = [int(arc) for arc in dotted.split(".")]
    body = bytes([40 * arcs[0] + arcs[1]])
    for arc in arcs[2:]:
        chunk = [arc & 0x7F]
        while arc > 0x7F:
            arc >>= 7
            chunk.insert(0, 0x80 | arc & 0x7F)
        body += bytes(chunk)
    return _der(0x06, body)


def _entry(arc: str, value: bytes) -> bytes:
    return _der(0x30, _oid(f"{SGX_OID}.{arc}") + value)


def _integer(value: int) -> bytes:
    return _der(0x02, value.to_bytes((value.bit_length() + 8) // 8, "big"))


def sgx_extension(fmspc: bytes = FMSPC, tcb: Sequence[int] = PCK_TCB, pcesvn: int = PCESVN) -> bytes:
    """The PCK certificate's SGX extension, DER, as Intel's PCK Certificate profile lays it out."""
    components = b"".join(_entry(f"2.{arc}", _integer(svn)) for arc, svn in enumerate(tcb, start=1))
    components += _entry("2.17", _integer(pcesvn)) + _entry("2.18", _der(0x04, bytes(tcb)))
    return _der(0x30, _entry("1", _der(0x04, bytes(16))) + _entry("2", _der(0x30, components))
                + _entry("3", _der(0x04, PCEID)) + _entry("4", _der(0x04, fmspc)) + _entry("5", _der(0x0A, b"\x00")))


def qe_report(mrsigner: bytes = QE_MRSIGNER, isvsvn: int = QE_ISVSVN) -> bytearray:
    """A TD QE report body (384 bytes) shaped like Intel's; REPORTDATA is left for the quote to fill."""
    report = bytearray(384)
    report[0x30:0x40] = QE_ATTRIBUTES
    report[0x80:0xA0] = mrsigner
    struct.pack_into("<HH", report, 0x100, QE_ISVPRODID, isvsvn)
    return report


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
    body_type: int | None = None,
    tee_tcb_svn: bytes = TEE_TCB_SVN,
    qe_mrsigner: bytes = QE_MRSIGNER,
    qe_isvsvn: int = QE_ISVSVN,
    qe_report_data: bytes | None = None,
    qe_signing_key: ec.EllipticCurvePrivateKey | None = None,
    chain_pem: bytes | None = None,
    trailing: bytes = b"",
) -> bytes:
    """A signed v4 quote, or v5 with `body_type` (2: TD 1.0, 3: TD 1.5); the other keyword arguments set one
    field or break one link each."""
    attestation_key = attestation_key or ec.generate_private_key(ec.SECP256R1())
    header = struct.pack("<HHI4s16s20s", 5 if body_type else version, 2, 0x81, bytes(4), INTEL_QE_VENDOR, bytes(20))
    body = bytearray(648 if body_type == 3 else 584)
    body[0x000:0x010] = tee_tcb_svn
    body[0x078:0x080] = td_attributes.to_bytes(8, "little")
    body[0x088:0x0B8] = mrtd
    body[0x208:0x248] = report_data
    descriptor = b"" if body_type is None else struct.pack("<HI", body_type, len(body))
    signed = header + descriptor + bytes(body)
    key_point = point(attestation_key)
    qe = qe_report(qe_mrsigner, qe_isvsvn)
    binding = hashlib.sha256(key_point + QE_AUTH_DATA).digest() + bytes(32)
    qe[0x140:0x180] = binding if qe_report_data is None else qe_report_data
    chain = pki.chain_pem if chain_pem is None else chain_pem
    qe_certification = (
        bytes(qe)
        + raw_signature(qe_signing_key or pki.pck_key, bytes(qe))
        + struct.pack("<H", len(QE_AUTH_DATA)) + QE_AUTH_DATA
        + struct.pack("<HI", 5, len(chain)) + chain
    )
    signature_data = (
        raw_signature(attestation_key, signed) + key_point + struct.pack("<HI", 6, len(qe_certification))
        + qe_certification
    )
    return signed + struct.pack("<I", len(signature_data)) + signature_data + trailing


def tcb_level(sgx: Sequence[int], pcesvn: int, tdx: Sequence[int], status: str, advisories: Sequence[str] = ()
              ) -> dict[str, Any]:
    level: dict[str, Any] = {
        "tcb": {"sgxtcbcomponents": [{"svn": svn} for svn in sgx], "pcesvn": pcesvn,
                "tdxtcbcomponents": [{"svn": svn} for svn in tdx]},
        "tcbDate": "2026-01-01T00:00:00Z", "tcbStatus": status}
    if advisories:
        level["advisoryIDs"] = list(advisories)
    return level


UP_TO_DATE = tcb_level(PCK_TCB, PCESVN, TEE_TCB_SVN, "UpToDate")
OUT_OF_DATE = tcb_level((2, 2) + PCK_TCB[2:], PCESVN, TEE_TCB_SVN, "OutOfDate", ("INTEL-SA-00837", "INTEL-SA-00960"))
"""A level the platform meets only below UpToDate: a higher UpToDate level (SGX component 01 at 4) precedes it."""


def signed_body(key: ec.EllipticCurvePrivateKey, member: str, value: dict[str, Any]) -> bytes:
    """A PCS body: the member's compact JSON and the r || s hex signature over exactly those bytes."""
    inner = json.dumps(value, separators=(",", ":")).encode()
    signature = raw_signature(key, inner).hex().encode()
    return b'{"' + member.encode() + b'":' + inner + b',"signature":"' + signature + b'"}'


def tcb_info(pki: IntelPki, levels: Sequence[dict[str, Any]] = (UP_TO_DATE,), fmspc: bytes = FMSPC,
             next_update: datetime = NOW + timedelta(days=30), module_mrsigner: bytes = bytes(48)) -> bytes:
    zero_module = {"mrsigner": module_mrsigner.hex(), "attributes": "00" * 8, "attributesMask": "FF" * 8}
    return signed_body(pki.tcb_signing_key, "tcbInfo", {
        "id": "TDX", "version": 3, "issueDate": _time(NOW - timedelta(days=1)), "nextUpdate": _time(next_update),
        "fmspc": fmspc.hex(), "pceId": PCEID.hex(), "tcbType": 0, "tcbEvaluationDataNumber": 17,
        "tdxModule": zero_module, "tcbLevels": list(levels)})


def qe_identity(pki: IntelPki, levels: Sequence[tuple[int, str]] = ((QE_ISVSVN, "UpToDate"),)) -> bytes:
    return signed_body(pki.tcb_signing_key, "enclaveIdentity", {
        "id": "TD_QE", "version": 2, "issueDate": _time(NOW - timedelta(days=1)),
        "nextUpdate": _time(NOW + timedelta(days=30)), "tcbEvaluationDataNumber": 17, "miscselect": "00000000",
        "miscselectMask": "FFFFFFFF", "attributes": "11000000000000000000000000000000",
        "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000", "mrsigner": QE_MRSIGNER.hex().upper(),
        "isvprodid": QE_ISVPRODID,
        "tcbLevels": [{"tcb": {"isvsvn": svn}, "tcbDate": "2026-01-01T00:00:00Z", "tcbStatus": status}
                      for svn, status in levels]})


def crl(issuer_key: ec.EllipticCurvePrivateKey, issuer_name: str, revoked: Sequence[int] = ()) -> bytes:
    """A DER CRL of `issuer_name` naming the serial numbers `revoked`, current at NOW."""
    builder = (x509.CertificateRevocationListBuilder()
               .issuer_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, issuer_name)]))
               .last_update(NOW - timedelta(days=1)).next_update(NOW + timedelta(days=30)))
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW - timedelta(days=2)).build())
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def intel_collateral(pki: IntelPki, **files: bytes) -> Collateral:
    """Everything Intel PCS serves for the forged platform, current at NOW; `files` replace (b"": remove) any."""
    chain = pem(pki.tcb_signing, pki.root)
    intel = {f"tcb_info_{FMSPC.hex()}.json": tcb_info(pki), "tcb_info_issuer_chain.pem": chain,
             "qe_identity.json": qe_identity(pki), "qe_identity_issuer_chain.pem": chain,
             "pck_crl_platform.der": crl(pki.platform_key, PLATFORM_CA_NAME),
             "pck_crl_issuer_chain.pem": pem(pki.platform, pki.root), "root_crl.der": crl(pki.root_key, ROOT_NAME)}
    intel.update(files)
    present = {name: data for name, data in intel.items() if data}
    tcb_infos = {name[len("tcb_info_"):-len(".json")]: present.pop(name)
                 for name in list(present) if name.startswith("tcb_info_") and name.endswith(".json")}
    return Collateral(directory=Path("forged"), intel_tcb_infos=tcb_infos, intel=present)


def _time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
