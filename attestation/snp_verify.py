"""Verifying SEV-SNP evidence: chain, signature, TCB, chip, policy, measurement and key binding.

Order: the report's format, the VCEK's chain to a trusted ARK, the report signature under the VCEK,
then what the signed report says (TCB and chip against the VCEK, the debug bit, the measurement,
report_data). Nothing the report says is believed before its signature verifies.

The VCEK's AMD extensions, under 1.3.6.1.4.1.3704.1 (AMD KDS, as go-sev-guest `kds` reads them):

    .2      product name, IA5String ("Milan-B0")
    .3.1    BL_SPL    .3.2 TEE_SPL   .3.3 SNP_SPL   .3.4-.3.7 SPL4-SPL7 (reserved)   .3.8 UCODE_SPL
    .3.9    FMC_SPL (Turin; seen only in third-party verifiers)
    .4      HWID: the raw 64-byte chip id, with no OCTET STRING tag of its own

Each SPL is a DER INTEGER. The VCEK's TCB must equal the report's REPORTED_TCB byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from attestation.chain import AMD_SCHEME, ARK_FILE, TrustRoots, describe_path, verify_chain
from attestation.checks import Check, CheckSink, Expectations, Platform, check_key_binding, check_measurement
from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.snp_report import (
    ASK_GUID,
    SIGNATURE_ALGO_ECDSA_P384_SHA384,
    SIGNING_KEY_NAMES,
    SIGNING_KEY_VCEK,
    TCB_LAYOUTS,
    VCEK_GUID,
    Generation,
    SnpReport,
    format_tcb,
    parse_cert_table,
    parse_snp_report,
    tcb_components,
)

P384_BYTES = 48

AMD_KDS_OID = "1.3.6.1.4.1.3704.1"
PRODUCT_OID = x509.ObjectIdentifier(f"{AMD_KDS_OID}.2")
HWID_OID = x509.ObjectIdentifier(f"{AMD_KDS_OID}.4")
SPL_OIDS: dict[str, x509.ObjectIdentifier] = {
    name: x509.ObjectIdentifier(f"{AMD_KDS_OID}.3.{arc}")
    for name, arc in (("bl", 1), ("tee", 2), ("snp", 3), ("spl4", 4), ("spl5", 5), ("spl6", 6), ("spl7", 7),
                      ("ucode", 8), ("fmc", 9))
}
RESERVED_SPLS = frozenset({"spl4", "spl5", "spl6", "spl7"})
"""Reserved TCB bytes: a VCEK without these extensions certifies zero there."""
HWID_BYTES = 64
_DER_INTEGER, _DER_IA5STRING = 0x02, 0x16


def verify_snp(evidence: Evidence, roots: TrustRoots, expect: Expectations, emit: CheckSink) -> Platform:
    """Run every SEV-SNP check, emitting each that passes; returns what the report proved."""
    report = parse_snp_report(evidence.report)
    _check_format(report)
    emit(Check("report", f"SEV-SNP version {report.version}, VMPL {report.vmpl}, {len(evidence.report)} bytes"))

    certs = parse_cert_table(evidence.aux)
    if VCEK_GUID not in certs:
        raise VerificationError(
            "missing-certificate",
            "the evidence carries no VCEK: the host supplied no certificate table (auxblob), so the "
            "report's signing key cannot be checked",
        )
    vcek = read_vcek(certs[VCEK_GUID])
    carried = list(roots.amd_asks) + ([_der(certs[ASK_GUID], "ASK")] if ASK_GUID in certs else [])
    path = verify_chain(vcek.certificate, carried, roots.roots_in(ARK_FILE, "sev-snp"), AMD_SCHEME, expect.now)
    emit(Check("certificate chain", describe_path(path, AMD_SCHEME)))

    _check_signature(report, vcek)
    emit(Check("report signature", "ECDSA P-384 SHA-384 over bytes [0x000, 0x2A0) by the VCEK"))
    emit(_check_tcb(report, vcek))
    emit(_check_chip_id(report, vcek))
    if report.debug:
        raise VerificationError(
            "debug-enabled", f"guest policy {report.policy:#x} has DEBUG (bit 19) set: the host can read guest memory"
        )
    emit(Check("policy", f"{report.policy:#x}, debug off"))
    emit(check_measurement(report.measurement, expect.measurement, "MEASUREMENT"))
    emit(check_key_binding(report.report_data, evidence))
    return Platform(report.measurement, tcb=tcb_components(report.reported_tcb, report.generation),
                    not_checked=("revocation: AMD KDS CRLs are not consulted yet",))


def _check_format(report: SnpReport) -> None:
    if report.signature_algo != SIGNATURE_ALGO_ECDSA_P384_SHA384:
        raise VerificationError(
            "unsupported-report", f"signature algorithm {report.signature_algo}; only 1 (ECDSA P-384 SHA-384) is known"
        )
    if report.signing_key != SIGNING_KEY_VCEK:
        name = SIGNING_KEY_NAMES.get(report.signing_key, f"reserved value {report.signing_key}")
        raise VerificationError("unsupported-report", f"the report is signed by {name}; only VCEK reports are checked")


def _check_signature(report: SnpReport, vcek: Vcek) -> None:
    for name, component in (("R", report.signature_r), ("S", report.signature_s)):
        if any(component[P384_BYTES:]):
            raise VerificationError(
                "bad-report-signature",
                f"signature {name} is not a little-endian 384-bit integer (its top 24 bytes are not zero; "
                "was it stored big-endian?)",
            )
    signature = encode_dss_signature(
        int.from_bytes(report.signature_r, "little"), int.from_bytes(report.signature_s, "little")
    )
    try:
        vcek.public_key.verify(signature, report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature as exc:
        raise VerificationError(
            "bad-report-signature", "the report's signature does not verify under the VCEK: the report was changed"
        ) from exc


def _check_tcb(report: SnpReport, vcek: Vcek) -> Check:
    generation = report.generation
    certified = vcek.tcb(generation)
    if report.reported_tcb != certified:
        raise VerificationError(
            "tcb-mismatch",
            f"REPORTED_TCB is {format_tcb(report.reported_tcb, generation)}, the VCEK certifies "
            f"{format_tcb(certified, generation)}",
        )
    current = tcb_components(report.current_tcb, generation)
    below = [name for name, value in tcb_components(certified, generation).items() if current[name] < value]
    if below:
        raise VerificationError(
            "tcb-mismatch",
            f"CURRENT_TCB {format_tcb(report.current_tcb, generation)} is below the VCEK's TCB in {', '.join(below)}",
        )
    if report.committed_tcb != report.current_tcb:
        raise VerificationError(
            "tcb-mismatch",
            f"COMMITTED_TCB {format_tcb(report.committed_tcb, generation)} differs from CURRENT_TCB: the "
            "firmware runs provisionally",
        )
    return Check("tcb", f"{generation} {format_tcb(certified, generation)} equals the VCEK's; current equals committed")


def _check_chip_id(report: SnpReport, vcek: Vcek) -> Check:
    if not any(report.chip_id):
        return Check("chip id", "masked by the guest (MASK_CHIP_KEY); the VCEK's signature still names one chip")
    if vcek.hwid is None:
        raise VerificationError("bad-certificate", "the VCEK has no HWID extension to compare CHIP_ID with")
    if report.chip_id != vcek.hwid:
        raise VerificationError(
            "chip-id-mismatch", f"CHIP_ID {report.chip_id.hex()} is not the VCEK's HWID {vcek.hwid.hex()}"
        )
    return Check("chip id", f"{report.chip_id.hex()[:16]}... equals the VCEK's HWID")


def _der(der: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise VerificationError("bad-certificate", f"the {what} in the certificate table is not DER: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Vcek:
    certificate: x509.Certificate
    public_key: ec.EllipticCurvePublicKey  # P-384
    product: str | None
    spls: tuple[tuple[str, int], ...]  # (component, value) for every SPL extension present
    hwid: bytes | None  # None for a VLEK-style certificate without HWID

    def tcb(self, generation: Generation) -> bytes:
        """The certified TCB_VERSION in the report's byte layout for `generation`."""
        present = dict(self.spls)
        tcb = bytearray(8)
        for name, index in TCB_LAYOUTS[generation].items():
            if name not in present and name not in RESERVED_SPLS:
                raise VerificationError(
                    "bad-certificate", f"the VCEK has no {name.upper()}_SPL extension ({SPL_OIDS[name].dotted_string})"
                )
            tcb[index] = present.get(name, 0)
        return bytes(tcb)


def read_vcek(der: bytes) -> Vcek:
    """Parse a DER VCEK; raises `VerificationError("bad-certificate")` naming what is wrong."""
    try:
        certificate = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise VerificationError("bad-certificate", f"the VCEK is not a DER X.509 certificate: {exc}") from exc
    public_key = certificate.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or public_key.curve.name != "secp384r1":
        raise VerificationError("bad-certificate", "the VCEK's key is not an EC P-384 key")
    spls = []
    for name, oid in SPL_OIDS.items():
        value = _extension(certificate, oid)
        if value is not None:
            spls.append((name, _spl(value, name)))
    product = _extension(certificate, PRODUCT_OID)
    product_name = None if product is None else _der_content(product, _DER_IA5STRING, "product name")
    hwid = _extension(certificate, HWID_OID)
    if hwid is not None and len(hwid) != HWID_BYTES:
        raise VerificationError("bad-certificate", f"the VCEK's HWID is {len(hwid)} bytes, not {HWID_BYTES}")
    return Vcek(
        certificate=certificate,
        public_key=public_key,
        product=None if product_name is None else product_name.decode("ascii", "replace"),
        spls=tuple(spls),
        hwid=hwid,
    )


def _extension(certificate: x509.Certificate, oid: x509.ObjectIdentifier) -> bytes | None:
    try:
        extension = certificate.extensions.get_extension_for_oid(oid)
    except x509.ExtensionNotFound:
        return None
    value = extension.value
    if not isinstance(value, x509.UnrecognizedExtension):
        raise VerificationError("bad-certificate", f"extension {oid.dotted_string} has an unexpected type")
    return value.value


def _spl(encoded: bytes, name: str) -> int:
    content = _der_content(encoded, _DER_INTEGER, f"{name.upper()}_SPL")
    value = int.from_bytes(content, "big", signed=True)
    if not content or not 0 <= value <= 0xFF:
        raise VerificationError("bad-certificate", f"the VCEK's {name.upper()}_SPL is {value}, not a byte")
    return value


def _der_content(encoded: bytes, tag: int, what: str) -> bytes:
    """The content of a short-form DER value (an SPL INTEGER or the product IA5String)."""
    if len(encoded) < 2 or encoded[0] != tag or encoded[1] > 0x7F or encoded[1] != len(encoded) - 2:
        raise VerificationError("bad-certificate", f"the VCEK's {what} extension is not a short DER value")
    return encoded[2:]
