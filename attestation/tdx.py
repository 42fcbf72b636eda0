"""The Intel TDX quote (version 4, ECDSA P-256 attestation key; DCAP `sgx_quote_4.h`) and its verification.

    0x000 header (48): version u16 = 4, att_key_type u16 = 2 (ECDSA P-256), tee_type u32 = 0x81 (TDX),
                       reserved (4), QE vendor id (16), user data (20)
    0x030 TD report body (584): TEE_TCB_SVN 16, MRSEAM 48, MRSIGNERSEAM 48, SEAMATTRIBUTES 8,
                       TDATTRIBUTES 8, XFAM 8, MRTD 48, MRCONFIGID 48, MROWNER 48, MROWNERCONFIG 48,
                       RTMR0..3 4x48, REPORTDATA 64
    0x278 signature data length u32, then the signature data:
        quote signature r||s (64, big-endian) | attestation key X||Y (64, big-endian)
        certification data type u16 = 6 (QE report) | size u32 | QE report (384, REPORTDATA at 0x140)
        | QE report signature r||s (64) | QE auth data size u16 + bytes
        | certification data type u16 = 5 (PCK chain) | size u32 | PEM: PCK leaf, intermediate CA, root CA

Integers are little-endian; the quote signature covers [0x000, 0x278). Bytes after the signature
data are allowed and ignored (real quotes carry padding there).

Trust flows from the Intel root down: the PCK chain proves the PCK key belongs to a genuine
platform; the PCK key signs the quoting enclave's report; that report binds the attestation key
(REPORTDATA = SHA-256(attestation key || QE auth data) || zero); the attestation key signs the quote,
whose TD report carries our report_data. TCB status against Intel's collateral (tcbInfo, QE
identity, CRLs) is not evaluated: it needs Intel PCS data an offline verifier does not have.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from attestation.chain import INTEL_ROOT_FILE, INTEL_SCHEME, TrustRoots, describe_path, verify_chain
from attestation.checks import Check, CheckSink, Expectations, Platform, check_key_binding, check_measurement
from attestation.errors import VerificationError
from attestation.evidence import Evidence

QUOTE_VERSION = 4
ATT_KEY_TYPE_ECDSA_P256 = 2
TEE_TYPE_TDX = 0x81
SIGNED_BYTES = 0x278
SIGNATURE_DATA_OFFSET = 0x27C
QE_REPORT_CERTIFICATION = 6
PCK_CHAIN_CERTIFICATION = 5
QE_REPORT_BYTES = 384
QE_REPORT_DATA = slice(0x140, 0x180)
TD_ATTRIBUTES_DEBUG_BIT = 0
"""TDATTRIBUTES bit 0 (DEBUG): the TD runs in debug mode and the host can read its state (TDX module ABI)."""


@dataclass(frozen=True, slots=True)
class TdxQuote:
    version: int
    att_key_type: int
    tee_type: int
    qe_vendor_id: bytes  # [16]
    tee_tcb_svn: bytes  # [16]
    mrseam: bytes  # [48]
    td_attributes: int  # u64
    xfam: int  # u64
    mrtd: bytes  # [48], the TD's build-time measurement
    mrconfigid: bytes  # [48]
    rtmrs: tuple[bytes, bytes, bytes, bytes]  # runtime measurement registers, [48] each
    report_data: bytes  # [64]
    signed_bytes: bytes  # [0x000, 0x278)
    signature: bytes  # [64], r || s big-endian
    attestation_key: bytes  # [64], X || Y big-endian
    qe_report: bytes  # [384], SGX report body of the quoting enclave
    qe_report_signature: bytes  # [64], r || s big-endian, by the PCK leaf key
    qe_auth_data: bytes
    pck_chain_pem: bytes

    @property
    def qe_report_data(self) -> bytes:
        return self.qe_report[QE_REPORT_DATA]

    @property
    def debug(self) -> bool:
        return bool(self.td_attributes >> TD_ATTRIBUTES_DEBUG_BIT & 1)


def parse_tdx_quote(data: bytes) -> TdxQuote:
    """Parse a v4 quote; raises `VerificationError` (truncated, unsupported or malformed) saying where."""
    reader = _Reader(data)
    version, att_key_type, tee_type = struct.unpack_from("<HHI", reader.take(0, 8, "header"))
    if (version, att_key_type, tee_type) != (QUOTE_VERSION, ATT_KEY_TYPE_ECDSA_P256, TEE_TYPE_TDX):
        raise VerificationError(
            "unsupported-report",
            f"quote version {version}, attestation key type {att_key_type}, TEE type {tee_type:#x}; this verifier "
            f"reads version 4, key type 2 (ECDSA P-256), TEE type 0x81 (TDX)",
        )
    body = reader.take(0x30, 584, "TD report body")
    (signature_data_len,) = struct.unpack("<I", reader.take(SIGNED_BYTES, 4, "signature data length"))
    signature_data = _Reader(reader.take(SIGNATURE_DATA_OFFSET, signature_data_len, "signature data"))
    qe_data = signature_data.certification(128, QE_REPORT_CERTIFICATION, "QE report certification data")
    auth_len = qe_data.u16(QE_REPORT_BYTES + 64, "QE auth data size")
    auth_end = QE_REPORT_BYTES + 64 + 2 + auth_len
    pck_chain = qe_data.certification(auth_end, PCK_CHAIN_CERTIFICATION, "PCK certificate chain")
    return TdxQuote(
        version=version,
        att_key_type=att_key_type,
        tee_type=tee_type,
        qe_vendor_id=data[0x0C:0x1C],
        tee_tcb_svn=body[0x000:0x010],
        mrseam=body[0x010:0x040],
        td_attributes=int.from_bytes(body[0x078:0x080], "little"),
        xfam=int.from_bytes(body[0x080:0x088], "little"),
        mrtd=body[0x088:0x0B8],
        mrconfigid=body[0x0B8:0x0E8],
        rtmrs=(body[0x148:0x178], body[0x178:0x1A8], body[0x1A8:0x1D8], body[0x1D8:0x208]),
        report_data=body[0x208:0x248],
        signed_bytes=data[:SIGNED_BYTES],
        signature=signature_data.take(0, 64, "quote signature"),
        attestation_key=signature_data.take(64, 64, "attestation key"),
        qe_report=qe_data.take(0, QE_REPORT_BYTES, "QE report"),
        qe_report_signature=qe_data.take(QE_REPORT_BYTES, 64, "QE report signature"),
        qe_auth_data=qe_data.take(QE_REPORT_BYTES + 66, auth_len, "QE auth data"),
        pck_chain_pem=pck_chain.data,
    )


class _Reader:
    """Bounds-checked slices of one region of the quote."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self, offset: int, size: int, what: str) -> bytes:
        if offset + size > len(self.data):
            raise VerificationError(
                "truncated-report",
                f"the quote ends before its {what} ({size} bytes at {offset:#x} of a {len(self.data)}-byte region)",
            )
        return self.data[offset : offset + size]

    def u16(self, offset: int, what: str) -> int:
        return int.from_bytes(self.take(offset, 2, what), "little")

    def certification(self, offset: int, expected_type: int, what: str) -> _Reader:
        """The certification data (type u16, size u32, data) at `offset`, which must be of `expected_type`."""
        kind, size = struct.unpack("<HI", self.take(offset, 6, what))
        if kind != expected_type:
            raise VerificationError(
                "unsupported-report", f"{what} has certification data type {kind}, expected {expected_type}"
            )
        return _Reader(self.take(offset + 6, size, what))


def verify_tdx(evidence: Evidence, roots: TrustRoots, expect: Expectations, emit: CheckSink) -> Platform:
    """Run every TDX check, emitting each that passes; returns what the quote proved."""
    quote = parse_tdx_quote(evidence.report)
    emit(Check("quote", f"TDX v{quote.version}, ECDSA P-256 attestation key, QE vendor {quote.qe_vendor_id.hex()}"))

    pck_chain = _pck_chain(quote)
    path = verify_chain(pck_chain[0], pck_chain[1:], roots.roots_in(INTEL_ROOT_FILE, "tdx"), INTEL_SCHEME, expect.now)
    emit(Check("pck chain", describe_path(path, INTEL_SCHEME)))

    pck_key = pck_chain[0].public_key()
    if not isinstance(pck_key, ec.EllipticCurvePublicKey) or pck_key.curve.name != "secp256r1":
        raise VerificationError("bad-certificate", "the PCK certificate's key is not an EC P-256 key")
    if not _verifies(pck_key, quote.qe_report_signature, quote.qe_report):
        raise VerificationError(
            "bad-qe-signature", "the quoting enclave report's signature does not verify under the PCK key"
        )
    emit(Check("qe report signature", "ECDSA P-256 SHA-256 by the PCK key"))

    expected = hashlib.sha256(quote.attestation_key + quote.qe_auth_data).digest() + bytes(32)
    if not hmac.compare_digest(quote.qe_report_data, expected):
        raise VerificationError(
            "qe-binding-mismatch",
            f"QE REPORTDATA is {quote.qe_report_data.hex()}, SHA-256(attestation key || QE auth data) || zero is "
            f"{expected.hex()}: the attestation key was not certified by this quoting enclave",
        )
    emit(Check("qe binding", "QE REPORTDATA = SHA-256(attestation key || QE auth data) || zero"))

    if not _verifies(_attestation_key(quote), quote.signature, quote.signed_bytes):
        raise VerificationError(
            "bad-report-signature",
            "the quote's signature does not verify under its attestation key: the quote was changed",
        )
    emit(Check("quote signature", "ECDSA P-256 SHA-256 over bytes [0x000, 0x278) by the attestation key"))
    emit(Check("tcb", f"TEE_TCB_SVN {quote.tee_tcb_svn.hex()} (not evaluated: no Intel TCB collateral offline)"))
    if quote.debug:
        raise VerificationError(
            "debug-enabled", f"TDATTRIBUTES {quote.td_attributes:#x} has DEBUG (bit 0) set: the host can read the TD"
        )
    emit(Check("td attributes", f"{quote.td_attributes:#x}, debug off"))
    emit(check_measurement(quote.mrtd, expect.measurement, "MRTD"))
    emit(check_key_binding(quote.report_data, evidence))
    return Platform(quote.mrtd, rtmrs=quote.rtmrs, not_checked=(
        "tcb status: Intel's TCB info and QE identity are not evaluated yet",
        "revocation: Intel's CRLs are not consulted yet"))


def _pck_chain(quote: TdxQuote) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(quote.pck_chain_pem)
    except ValueError as exc:
        raise VerificationError("missing-certificate", f"the quote's PCK chain has no PEM certificate: {exc}") from exc


def _attestation_key(quote: TdxQuote) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + quote.attestation_key)
    except ValueError as exc:
        raise VerificationError("malformed-report", "the quote's attestation key is not a P-256 point") from exc


def _verifies(key: ec.EllipticCurvePublicKey, raw_signature: bytes, data: bytes) -> bool:
    """Whether r || s (32 bytes each, big-endian) is `key`'s ECDSA SHA-256 signature of `data`."""
    r, s = int.from_bytes(raw_signature[:32], "big"), int.from_bytes(raw_signature[32:], "big")
    try:
        key.verify(encode_dss_signature(r, s), data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True
