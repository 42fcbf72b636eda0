"""The Intel TDX quote (versions 4 and 5, ECDSA P-256 attestation key; DCAP `sgx_quote_4.h`, `sgx_quote_5.h`).

    0x000 header (48): version u16 = 4 or 5, att_key_type u16 = 2 (ECDSA P-256), tee_type u32 = 0x81 (TDX),
                       reserved (4), QE vendor id (16), user data (20)
    v4: 0x030 TD report body (584)
    v5: 0x030 body type u16 (2: TD 1.0 report, 3: TD 1.5 report) | 0x032 body size u32 (584, 648) | 0x036 body
    TD report body: TEE_TCB_SVN 16, MRSEAM 48, MRSIGNERSEAM 48, SEAMATTRIBUTES 8, TDATTRIBUTES 8, XFAM 8,
                    MRTD 48, MRCONFIGID 48, MROWNER 48, MROWNERCONFIG 48, RTMR0..3 4x48, REPORTDATA 64
                    (TD 1.5 appends TEE_TCB_SVN2 16, MRSERVICETD 48)
    after the body: signature data length u32, then the signature data:
        quote signature r||s (64, big-endian) | attestation key X||Y (64, big-endian)
        certification data type u16 = 6 (QE report) | size u32 | QE report (384, REPORTDATA at 0x140)
        | QE report signature r||s (64) | QE auth data size u16 + bytes
        | certification data type u16 = 5 (PCK chain) | size u32 | PEM: PCK leaf, intermediate CA, root CA

Integers are little-endian; the quote signature covers everything before the signature data length (v4
[0x000, 0x278), v5 [0x000, 0x036 + body size)). Bytes after the signature data are allowed and ignored (real
quotes carry padding there).

Trust flows from the Intel root down: the PCK chain proves the PCK key belongs to a genuine
platform; the PCK key signs the quoting enclave's report; that report binds the attestation key
(REPORTDATA = SHA-256(attestation key || QE auth data) || zero); the attestation key signs the quote,
whose TD report carries our report_data. Intel's collateral (`attestation.tdx_collateral`) then says whether
the quoting enclave is Intel's, which TCB status the platform has, and whether the PCK chain is revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.chain import INTEL_ROOT_FILE, INTEL_SCHEME, TrustRoots, describe_path, verify_chain
from attestation.checks import Check, CheckSink, Expectations, Platform, check_key_binding, check_measurement
from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.intel_signature import verifies
from attestation.pck_extensions import read_pck_extensions
from attestation.tdx_collateral import QeReport, QuotedTcb, judge_tcb

QUOTE_VERSIONS = (4, 5)
ATT_KEY_TYPE_ECDSA_P256 = 2
TEE_TYPE_TDX = 0x81
HEADER_BYTES = 0x30
V4_BODY_BYTES = 584
V5_BODY_BYTES = {2: 584, 3: 648}
"""v5 body type -> its size: 2 is the TD 1.0 report (as in v4), 3 the TD 1.5 report (TEE_TCB_SVN2, MRSERVICETD)."""
V5_BODY_NAMES = {2: "TD 1.0", 3: "TD 1.5"}
QE_REPORT_CERTIFICATION = 6
PCK_CHAIN_CERTIFICATION = 5
QE_REPORT_BYTES = 384
QE_REPORT_DATA = slice(0x140, 0x180)
TD_ATTRIBUTES_DEBUG_BIT = 0
"""TDATTRIBUTES bit 0 (DEBUG): the TD runs in debug mode and the host can read its state (TDX module ABI)."""


@dataclass(frozen=True, slots=True)
class TdxQuote:
    version: int
    body_type: int | None  # v5's TD report body type (2: TD 1.0, 3: TD 1.5); None for v4
    att_key_type: int
    tee_type: int
    qe_vendor_id: bytes  # [16]
    tee_tcb_svn: bytes  # [16]
    mrseam: bytes  # [48]
    mrsignerseam: bytes  # [48], zero for Intel's TDX module
    seam_attributes: bytes  # [8]
    td_attributes: int  # u64
    xfam: int  # u64
    mrtd: bytes  # [48], the TD's build-time measurement
    mrconfigid: bytes  # [48]
    rtmrs: tuple[bytes, bytes, bytes, bytes]  # runtime measurement registers, [48] each
    report_data: bytes  # [64]
    tee_tcb_svn2: bytes | None  # [16], TD 1.5 only
    mrservicetd: bytes | None  # [48], TD 1.5 only
    signed_bytes: bytes  # header and body: what the quote signature covers
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

    def describe(self) -> str:
        body = "" if self.body_type is None else f" ({V5_BODY_NAMES[self.body_type]} body)"
        return f"TDX v{self.version}{body}"


def parse_tdx_quote(data: bytes) -> TdxQuote:
    """Parse a v4 or v5 quote; raises `VerificationError` (truncated, unsupported or malformed) saying where."""
    reader = _Reader(data)
    version, att_key_type, tee_type = struct.unpack_from("<HHI", reader.take(0, 8, "header"))
    if version not in QUOTE_VERSIONS or (att_key_type, tee_type) != (ATT_KEY_TYPE_ECDSA_P256, TEE_TYPE_TDX):
        raise VerificationError(
            "unsupported-report",
            f"quote version {version}, attestation key type {att_key_type}, TEE type {tee_type:#x}; this verifier "
            f"reads versions 4 and 5, key type 2 (ECDSA P-256), TEE type 0x81 (TDX)",
        )
    body_type, body_offset, body_size = None, HEADER_BYTES, V4_BODY_BYTES
    if version == 5:
        body_type, body_size = struct.unpack("<HI", reader.take(HEADER_BYTES, 6, "TD report body descriptor"))
        if body_type not in V5_BODY_BYTES:
            raise VerificationError("unsupported-report", f"v5 quote body type {body_type}; this verifier reads "
                                    "types 2 (TD 1.0 report) and 3 (TD 1.5 report)")
        if body_size != V5_BODY_BYTES[body_type]:
            raise VerificationError("malformed-report", f"v5 quote body type {body_type} declares {body_size} bytes, "
                                    f"its report is {V5_BODY_BYTES[body_type]}")
        body_offset = HEADER_BYTES + 6
    body = reader.take(body_offset, body_size, "TD report body")
    signed_end = body_offset + body_size
    (signature_data_len,) = struct.unpack("<I", reader.take(signed_end, 4, "signature data length"))
    signature_data = _Reader(reader.take(signed_end + 4, signature_data_len, "signature data"))
    qe_data = signature_data.certification(128, QE_REPORT_CERTIFICATION, "QE report certification data")
    auth_len = qe_data.u16(QE_REPORT_BYTES + 64, "QE auth data size")
    auth_end = QE_REPORT_BYTES + 64 + 2 + auth_len
    pck_chain = qe_data.certification(auth_end, PCK_CHAIN_CERTIFICATION, "PCK certificate chain")
    td15 = body_type == 3
    return TdxQuote(
        version=version,
        body_type=body_type,
        att_key_type=att_key_type,
        tee_type=tee_type,
        qe_vendor_id=data[0x0C:0x1C],
        tee_tcb_svn=body[0x000:0x010],
        mrseam=body[0x010:0x040],
        mrsignerseam=body[0x040:0x070],
        seam_attributes=body[0x070:0x078],
        td_attributes=int.from_bytes(body[0x078:0x080], "little"),
        xfam=int.from_bytes(body[0x080:0x088], "little"),
        mrtd=body[0x088:0x0B8],
        mrconfigid=body[0x0B8:0x0E8],
        rtmrs=(body[0x148:0x178], body[0x178:0x1A8], body[0x1A8:0x1D8], body[0x1D8:0x208]),
        report_data=body[0x208:0x248],
        tee_tcb_svn2=body[0x248:0x258] if td15 else None,
        mrservicetd=body[0x258:0x288] if td15 else None,
        signed_bytes=data[:signed_end],
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
    platform = verify_quote(quote, roots, expect, emit)
    emit(check_key_binding(quote.report_data, evidence))
    return platform


def verify_quote(quote: TdxQuote, roots: TrustRoots, expect: Expectations, emit: CheckSink) -> Platform:
    """Every check of the quote and Intel's collateral short of the key binding, which needs the evidence document:
    what a real quote, made for someone else's key, can still be held to."""
    emit(Check("quote", f"{quote.describe()}, ECDSA P-256 attestation key, QE vendor {quote.qe_vendor_id.hex()}"))

    pck_chain = _pck_chain(quote)
    path = verify_chain(pck_chain[0], pck_chain[1:], roots.roots_in(INTEL_ROOT_FILE, "tdx"), INTEL_SCHEME, expect.now)
    emit(Check("pck chain", describe_path(path, INTEL_SCHEME)))

    pck_key = pck_chain[0].public_key()
    if not isinstance(pck_key, ec.EllipticCurvePublicKey) or pck_key.curve.name != "secp256r1":
        raise VerificationError("bad-certificate", "the PCK certificate's key is not an EC P-256 key")
    if not verifies(pck_key, quote.qe_report_signature, quote.qe_report):
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

    if not verifies(_attestation_key(quote), quote.signature, quote.signed_bytes):
        raise VerificationError(
            "bad-report-signature",
            "the quote's signature does not verify under its attestation key: the quote was changed",
        )
    emit(Check("quote signature", f"ECDSA P-256 SHA-256 over bytes [0x000, {len(quote.signed_bytes):#05x}) by the "
                                  "attestation key"))
    quoted = QuotedTcb(tee_tcb_svn=quote.tee_tcb_svn, mrsignerseam=quote.mrsignerseam,
                       seam_attributes=quote.seam_attributes, qe=QeReport.read(quote.qe_report), pck_path=path,
                       pck=read_pck_extensions(path[0]))
    tcb = judge_tcb(quoted, roots, expect, emit)
    if quote.debug:
        raise VerificationError(
            "debug-enabled", f"TDATTRIBUTES {quote.td_attributes:#x} has DEBUG (bit 0) set: the host can read the TD"
        )
    emit(Check("td attributes", f"{quote.td_attributes:#x}, debug off"))
    emit(check_measurement(quote.mrtd, expect.measurement, "MRTD"))
    return Platform(quote.mrtd, rtmrs=quote.rtmrs, tcb_status=tcb.status, advisory_ids=tcb.advisory_ids,
                    not_checked=tcb.not_checked)


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
