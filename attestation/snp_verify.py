"""Verifying SEV-SNP evidence: chain, revocation, signature, product, TCB, chip, policy, measurement and key binding.

Order: the report's format, the signing key's chain to a trusted ARK, that chain's CRL, the report
signature under the key, then what the signed report says (its processor against the chain, TCB and
chip against the key, the debug bit, the measurement, report_data). Nothing the report says is
believed before its signature verifies.

AMD firmware signs with one of two keys (signer info bits 4:2), each with its own chain:

    VCEK  per chip and TCB    VCEK <- ASK  (CN=SEV-<Product>)       <- ARK (CN=ARK-<Product>)
    VLEK  per cloud provider  VLEK <- ASVK (CN=SEV-VLEK-<Product>)  <- ARK

The ASK or ASVK comes from the evidence's certificate table (the ASK GUID's entry holds either, as in
go-sev-guest) or from the trust directory's ask.pem, which may hold both kinds: the walk picks the
one the key names and verifies it under ark.pem, so where it came from does not matter.

The product (Milan, Genoa, Turin) is what the chain names. A v3+ report's CPUID must name the same;
the key's product extension is then ignored, as go-sev-guest does (some KDS certificates carried a
wrong one). A v2 report has no CPUID, and the extension, where present, must agree with the chain.

The key's AMD extensions, under 1.3.6.1.4.1.3704.1 (AMD KDS, as go-sev-guest `kds` and virtee/sev read them):

    .2      product name, IA5String ("Milan-B0"; "Turin"; a VLEK's has no stepping)
    .3.1    BL_SPL    .3.2 TEE_SPL   .3.3 SNP_SPL   .3.4-.3.7 SPL4-SPL7 (reserved)   .3.8 UCODE_SPL
    .3.9    FMC_SPL (Turin, whose VCEKs lack .3.4)
    .4      HWID (VCEK): the raw chip id, no OCTET STRING tag; 64 bytes, on Turin 8 (CHIP_ID's first 8, rest zero)
    .5      CSP_ID (VLEK), IA5String: the cloud provider the VLEK was issued to, instead of a HWID

Each SPL is a DER INTEGER. The key's TCB must equal the report's REPORTED_TCB byte for byte.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509.oid import NameOID

from attestation.chain import AMD_SCHEME, ARK_FILE, TrustRoots, check_crl, describe, describe_path, verify_chain
from attestation.checks import (
    Check,
    CheckSink,
    Expectations,
    Platform,
    SnpGuest,
    check_key_binding,
    check_measurement,
)
from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.snp_report import (
    ASK_GUID,
    GENERATIONS,
    SIGNATURE_ALGO_ECDSA_P384_SHA384,
    SIGNING_KEY_NAMES,
    SIGNING_KEY_VCEK,
    SIGNING_KEY_VLEK,
    TCB_LAYOUTS,
    VCEK_GUID,
    VLEK_GUID,
    Generation,
    Product,
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
CSP_ID_OID = x509.ObjectIdentifier(f"{AMD_KDS_OID}.5")
SPL_OIDS: dict[str, x509.ObjectIdentifier] = {
    name: x509.ObjectIdentifier(f"{AMD_KDS_OID}.3.{arc}")
    for name, arc in (("bl", 1), ("tee", 2), ("snp", 3), ("spl4", 4), ("spl5", 5), ("spl6", 6), ("spl7", 7),
                      ("ucode", 8), ("fmc", 9))
}
RESERVED_SPLS = frozenset({"spl4", "spl5", "spl6", "spl7"})
"""Reserved TCB bytes: a VCEK without these extensions certifies zero there."""
HWID_BYTES: dict[Generation, int] = {"milan-genoa": 64, "turin": 8}
CHIP_ID_BYTES = 64
_DER_INTEGER, _DER_IA5STRING = 0x02, 0x16


@dataclass(frozen=True, slots=True)
class SigningKey:
    """What differs between the two keys AMD firmware signs reports with."""

    name: str  # "VCEK", "VLEK"
    guid: uuid.UUID  # its certificate table entry
    intermediate: str  # the key's issuer, signed by the ARK: "ASK", "ASVK"
    issuer_prefix: str  # the intermediate's CN is issuer_prefix + product
    crl: str  # which AMD KDS CRL names its intermediate: collateral key "vcek" or "vlek"


SIGNING_KEYS: dict[int, SigningKey] = {
    SIGNING_KEY_VCEK: SigningKey("VCEK", VCEK_GUID, "ASK", "SEV-", "vcek"),
    SIGNING_KEY_VLEK: SigningKey("VLEK", VLEK_GUID, "ASVK", "SEV-VLEK-", "vlek"),
}
"""Signer info SIGNING_KEY -> its key; any other value (reserved, or 7: no key) is refused."""


def verify_snp(evidence: Evidence, roots: TrustRoots, expect: Expectations, emit: CheckSink) -> Platform:
    """Run every SEV-SNP check, emitting each that passes; returns what the report proved."""
    report = parse_snp_report(evidence.report)
    signing_key = _check_format(report)
    emit(Check("report", f"SEV-SNP version {report.version}, VMPL {report.vmpl}, {len(evidence.report)} bytes"))

    certs = parse_cert_table(evidence.aux)
    if signing_key.guid not in certs:
        raise VerificationError(
            "missing-certificate",
            f"the evidence carries no {signing_key.name}: the host supplied no certificate table (auxblob) or none "
            "with that key, so the report's signing key cannot be checked",
        )
    key = read_vcek(certs[signing_key.guid], signing_key.name)
    carried = list(roots.amd_asks) + ([_der(certs[ASK_GUID], signing_key.intermediate)] if ASK_GUID in certs else [])
    path = verify_chain(key.certificate, carried, roots.roots_in(ARK_FILE, "sev-snp"), AMD_SCHEME, expect.now)
    product = chain_product(path, signing_key)
    emit(Check("certificate chain", describe_path(path, AMD_SCHEME)))
    not_checked = _check_revocation(path, signing_key, product, expect, emit)

    _check_signature(report, key)
    emit(Check("report signature", f"ECDSA P-384 SHA-384 over bytes [0x000, 0x2A0) by the {signing_key.name}"))
    emit(_check_product(report, key, product))
    generation = GENERATIONS[product]
    emit(_check_tcb(report, key, generation))
    emit(_check_chip_id(report, key, generation))
    if report.debug:
        raise VerificationError(
            "debug-enabled", f"guest policy {report.policy:#x} has DEBUG (bit 19) set: the host can read guest memory"
        )
    emit(Check("policy", f"{report.policy:#x}, debug off"))
    emit(check_measurement(report.measurement, expect.measurement, "MEASUREMENT"))
    emit(check_key_binding(report.report_data, evidence))
    guest = SnpGuest(signing_key=signing_key.name, product=product, vmpl=report.vmpl, policy=report.policy,
                     host_data=report.host_data, id_key_digest=report.id_key_digest,
                     author_key_digest=report.author_key_digest, family_id=report.family_id, image_id=report.image_id)
    return Platform(report.measurement, tcb=tcb_components(report.reported_tcb, generation), snp=guest,
                    not_checked=not_checked)


def _check_format(report: SnpReport) -> SigningKey:
    if report.signature_algo != SIGNATURE_ALGO_ECDSA_P384_SHA384:
        raise VerificationError(
            "unsupported-report", f"signature algorithm {report.signature_algo}; only 1 (ECDSA P-384 SHA-384) is known"
        )
    signing_key = SIGNING_KEYS.get(report.signing_key)
    if signing_key is None:
        name = SIGNING_KEY_NAMES.get(report.signing_key, f"reserved value {report.signing_key}")
        raise VerificationError(
            "unsupported-report", f"the report is signed by {name}; only VCEK and VLEK reports are checked"
        )
    return signing_key


def chain_product(path: tuple[x509.Certificate, ...], signing_key: SigningKey) -> Product:
    """The product a verified path names: key <- `issuer_prefix`<Product> <- ARK-<Product>, nothing else.

    Raises `untrusted-chain` for any other shape: a VLEK under an ASK (or the reverse) is not AMD's chain for it.
    """
    issuer = _common_name(path[0].issuer)
    named = [product for product in GENERATIONS if issuer == signing_key.issuer_prefix + product]
    if not named:
        names = ", ".join(signing_key.issuer_prefix + product for product in GENERATIONS)
        raise VerificationError(
            "untrusted-chain",
            f"the {signing_key.name} is issued by CN={issuer}, not by an {signing_key.intermediate} ({names})",
        )
    product = named[0]
    if len(path) != 3 or _common_name(path[2].subject) != f"ARK-{product}":
        raise VerificationError(
            "untrusted-chain",
            f"the {signing_key.name}'s path {describe_path(path, AMD_SCHEME)} is not {signing_key.name} <- "
            f"{signing_key.intermediate} <- ARK-{product}",
        )
    return product


def _common_name(name: x509.Name) -> str:
    names = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if len(names) == 1 else ""
    return value if isinstance(value, str) else ""


def _check_revocation(
    path: tuple[x509.Certificate, ...], signing_key: SigningKey, product: Product, expect: Expectations,
    emit: CheckSink,
) -> tuple[str, ...]:
    """AMD KDS's per-product CRL is issued and signed by the ARK: it names revoked ASKs (ASVKs on the VLEK
    CRL), and a key listed there by serial is refused too. Returns what was not checked."""
    file = f"amd/{signing_key.crl}_crl_{product}.der"
    crl = expect.collateral.amd_crls.get((signing_key.crl, product))
    if crl is None:
        where = "no collateral given" if expect.collateral.directory is None else expect.collateral.path(file)
        return (f"revocation: no AMD CRL for {product} in the collateral ({where})",)
    key, intermediate, ark = path
    source = expect.collateral.path(file)
    check_crl(intermediate, ark, crl, source, expect.now)
    with _serial_zero_tolerated():  # the CRL lookup reads the key's serial number
        check_crl(key, ark, crl, source, expect.now)
    emit(Check("revocation", f"neither the {signing_key.intermediate} nor the {signing_key.name} is on "
                             f"{describe(ark)}'s CRL {source}"))
    return ()


def _check_signature(report: SnpReport, key: Vcek) -> None:
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
        key.public_key.verify(signature, report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature as exc:
        raise VerificationError(
            "bad-report-signature",
            f"the report's signature does not verify under the {key.name}: the report was changed",
        ) from exc


def _check_product(report: SnpReport, key: Vcek, product: Product) -> Check:
    reported = report.product
    if reported is not None:
        cpuid = f"CPUID family {report.cpuid_family:#04x} model {report.cpuid_model:#04x}"
        if reported != product:
            raise VerificationError(
                "untrusted-chain",
                f"the report's {cpuid} is {reported}, but its {key.name} chains to ARK-{product}: the chain is "
                "another processor's",
            )
        return Check("product", f"{product}: the report's {cpuid} and the chain agree")
    line = None if key.product is None else key.product.split("-")[0]
    if line is not None and line != product:
        raise VerificationError(
            "bad-certificate", f"the {key.name}'s product extension is {key.product}, but it chains to ARK-{product}"
        )
    return Check("product", f"{product}, from the chain (a version {report.version} report names no CPUID)")


def _check_tcb(report: SnpReport, key: Vcek, generation: Generation) -> Check:
    certified = key.tcb(generation)
    if report.reported_tcb != certified:
        raise VerificationError(
            "tcb-mismatch",
            f"REPORTED_TCB is {format_tcb(report.reported_tcb, generation)}, the {key.name} certifies "
            f"{format_tcb(certified, generation)}",
        )
    current = tcb_components(report.current_tcb, generation)
    below = [name for name, value in tcb_components(certified, generation).items() if current[name] < value]
    if below:
        raise VerificationError(
            "tcb-mismatch",
            f"CURRENT_TCB {format_tcb(report.current_tcb, generation)} is below the {key.name}'s TCB in "
            f"{', '.join(below)}",
        )
    if report.committed_tcb != report.current_tcb:
        raise VerificationError(
            "tcb-mismatch",
            f"COMMITTED_TCB {format_tcb(report.committed_tcb, generation)} differs from CURRENT_TCB: the "
            "firmware runs provisionally",
        )
    return Check(
        "tcb", f"{generation} {format_tcb(certified, generation)} equals the {key.name}'s; current equals committed"
    )


def _check_chip_id(report: SnpReport, key: Vcek, generation: Generation) -> Check:
    if key.csp_id is not None:
        return Check("chip id", f"not compared: a VLEK names a cloud provider (CSP_ID {key.csp_id}), not a chip")
    if not any(report.chip_id):
        return Check("chip id", "masked by the guest (MASK_CHIP_KEY); the VCEK's signature still names one chip")
    if key.hwid is None:
        raise VerificationError("bad-certificate", "the VCEK has no HWID extension to compare CHIP_ID with")
    if len(key.hwid) != HWID_BYTES[generation]:
        raise VerificationError(
            "bad-certificate", f"the VCEK's HWID is {len(key.hwid)} bytes; a {generation} VCEK's is "
            f"{HWID_BYTES[generation]}")
    padding = CHIP_ID_BYTES - len(key.hwid)
    if report.chip_id != key.hwid + bytes(padding):
        zeros = f" followed by {padding} zero bytes" if padding else ""
        raise VerificationError(
            "chip-id-mismatch", f"CHIP_ID {report.chip_id.hex()} is not the VCEK's HWID {key.hwid.hex()}{zeros}"
        )
    rest = f" (its {padding} bytes after the HWID are zero)" if padding else ""
    return Check("chip id", f"{report.chip_id.hex()[:16]}... equals the VCEK's HWID{rest}")


def _der(der: bytes, what: str) -> x509.Certificate:
    try:
        return _load_der(der)
    except ValueError as exc:
        raise VerificationError("bad-certificate", f"the {what} in the certificate table is not DER: {exc}") from exc


def _load_der(der: bytes) -> x509.Certificate:
    with _serial_zero_tolerated():
        return x509.load_der_x509_certificate(der)


@contextmanager
def _serial_zero_tolerated() -> Iterator[None]:
    """Every VCEK AMD KDS issues has serial number 0, which RFC 5280 forbids: cryptography warns when it parses or
    reads one. That is AMD's practice, not a fault of the evidence, so the warning must not surface (nor become an
    error where warnings are errors); only this warning is silenced, and only around reading AMD certificates."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Parsed a serial number which wasn't positive",
                                category=CryptographyDeprecationWarning)
        yield


@dataclass(frozen=True, slots=True)
class Vcek:
    """A VCEK or a VLEK: one certificate shape, with a HWID (VCEK) or a CSP_ID (VLEK)."""

    name: str  # "VCEK" or "VLEK", for messages
    certificate: x509.Certificate
    public_key: ec.EllipticCurvePublicKey  # P-384
    product: str | None  # the product extension ("Milan-B0", "Turin", "Milan")
    spls: tuple[tuple[str, int], ...]  # (component, value) for every SPL extension present
    hwid: bytes | None  # VCEK: 64 bytes (Milan, Genoa) or 8 (Turin); None for a VLEK
    csp_id: str | None = None  # VLEK: the cloud provider; None for a VCEK

    def tcb(self, generation: Generation) -> bytes:
        """The certified TCB_VERSION in the report's byte layout for `generation`."""
        present = dict(self.spls)
        tcb = bytearray(8)
        for name, index in TCB_LAYOUTS[generation].items():
            if name not in present and name not in RESERVED_SPLS:
                raise VerificationError(
                    "bad-certificate",
                    f"the {self.name} has no {name.upper()}_SPL extension ({SPL_OIDS[name].dotted_string})",
                )
            tcb[index] = present.get(name, 0)
        return bytes(tcb)


def read_vcek(der: bytes, name: str = "VCEK") -> Vcek:
    """Parse a DER VCEK (or, with `name="VLEK"`, a VLEK); raises `VerificationError("bad-certificate")` naming what
    is wrong. A VCEK carries a HWID and no CSP_ID, a VLEK the reverse."""
    try:
        certificate = _load_der(der)
    except ValueError as exc:
        raise VerificationError("bad-certificate", f"the {name} is not a DER X.509 certificate: {exc}") from exc
    public_key = certificate.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or public_key.curve.name != "secp384r1":
        raise VerificationError("bad-certificate", f"the {name}'s key is not an EC P-384 key")
    spls = []
    for component, oid in SPL_OIDS.items():
        value = _extension(certificate, oid)
        if value is not None:
            spls.append((component, _spl(value, component, name)))
    product = _ia5_extension(certificate, PRODUCT_OID, "product name", name)
    hwid = _extension(certificate, HWID_OID)
    if hwid is not None and len(hwid) not in HWID_BYTES.values():
        raise VerificationError(
            "bad-certificate", f"the {name}'s HWID is {len(hwid)} bytes, not 64 (Milan, Genoa) or 8 (Turin)"
        )
    csp_id = _ia5_extension(certificate, CSP_ID_OID, "CSP_ID", name)
    if name == "VCEK" and csp_id is not None:
        raise VerificationError("bad-certificate", f"the VCEK has a CSP_ID ({csp_id}): it is a VLEK")
    if name == "VLEK" and (csp_id is None or hwid is not None):
        raise VerificationError("bad-certificate", "a VLEK has a CSP_ID extension and no HWID; this one does not")
    return Vcek(name=name, certificate=certificate, public_key=public_key, product=product, spls=tuple(spls),
                hwid=hwid, csp_id=csp_id)


def _extension(certificate: x509.Certificate, oid: x509.ObjectIdentifier) -> bytes | None:
    try:
        extension = certificate.extensions.get_extension_for_oid(oid)
    except x509.ExtensionNotFound:
        return None
    value = extension.value
    if not isinstance(value, x509.UnrecognizedExtension):
        raise VerificationError("bad-certificate", f"extension {oid.dotted_string} has an unexpected type")
    return value.value


def _ia5_extension(certificate: x509.Certificate, oid: x509.ObjectIdentifier, what: str, name: str) -> str | None:
    value = _extension(certificate, oid)
    if value is None:
        return None
    return _der_content(value, _DER_IA5STRING, what, name).decode("ascii", "replace")


def _spl(encoded: bytes, component: str, name: str) -> int:
    content = _der_content(encoded, _DER_INTEGER, f"{component.upper()}_SPL", name)
    value = int.from_bytes(content, "big", signed=True)
    if not content or not 0 <= value <= 0xFF:
        raise VerificationError("bad-certificate", f"the {name}'s {component.upper()}_SPL is {value}, not a byte")
    return value


def _der_content(encoded: bytes, tag: int, what: str, name: str) -> bytes:
    """The content of a short-form DER value (an SPL INTEGER, the product or CSP_ID IA5String)."""
    if len(encoded) < 2 or encoded[0] != tag or encoded[1] > 0x7F or encoded[1] != len(encoded) - 2:
        raise VerificationError("bad-certificate", f"the {name}'s {what} extension is not a short DER value")
    return encoded[2:]
