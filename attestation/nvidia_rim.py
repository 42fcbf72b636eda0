"""NVIDIA RIM files: the driver's and the VBIOS's reference measurements, each signed by NVIDIA's RIM chain.

A RIM (TCG Reference Integrity Manifest) is a SWID tag (ISO 19770-2 XML) with an enveloped XML signature
(ECDSA P-384, SHA-384, C14N 1.1) whose KeyInfo carries the signing chain:

    HCC RIM L4 Signer <- NVIDIA Reference Value L3 GH100 001 <- NVIDIA Reference Value GH100 CA
        <- NVIDIA CoRIM signing Root CA          (nvidia_rim_root.pem in the trust directory)

    <SoftwareIdentity> <Meta colloquialVersion="550.90.07" .../>     the driver version, or the VBIOS version
      <Payload> <Resource type="Measurement" index="1" active="True" alternatives="1" size="48"
                          name="..." sha384:Hash0="hex"/> ...

RIM index i is SPDM measurement block i + 1. A GPU's report is judged against two RIMs, chosen as nvtrust
chooses them: the driver RIM whose version is the report's driver version and the VBIOS RIM whose version
is the report's VBIOS version. Every active reference value must be met by the report (any alternative),
and no index may be active in both.

The chain is verified here (`attestation.chain`, at the verification time); signxml then checks the
signature with the verified leaf only. Its own chain validation (web-PKI profile, the wall clock) refuses
NVIDIA's real chain. Values are read from the XML signxml returns as signed, never from the file as given.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from cryptography import x509
from lxml import etree
from signxml import DigestAlgorithm, SignatureConfiguration, SignatureMethod, VerifyResult, XMLVerifier
from signxml.exceptions import SignXMLException

from attestation.chain import NVIDIA_SCHEME, verify_chain
from attestation.errors import VerificationError

SWID = "{http://standards.iso.org/iso/19770/-2/2015/schema.xsd}"
DSIG = "{http://www.w3.org/2000/09/xmldsig#}"
SHA384_HASH = "{http://www.w3.org/2001/04/xmlenc#sha384}Hash"


@dataclass(frozen=True, slots=True)
class ReferenceValue:
    index: int  # RIM index: SPDM measurement block index - 1
    name: str  # "HashedMeasurement_1_FSP"
    values: tuple[bytes, ...]  # the alternatives; a measurement matches any one
    active: bool  # inactive values are not compared


@dataclass(frozen=True, slots=True)
class Rim:
    """One verified RIM file."""

    source: str  # its file name in the collateral
    version: str  # colloquialVersion, lowercase: "550.90.07" (driver) or "96.00.5e.00.01" (VBIOS)
    values: tuple[ReferenceValue, ...]  # ascending by index
    signer_path: tuple[x509.Certificate, ...]  # the RIM signing certificate -> ... -> NVIDIA RIM root


_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False)
_SIGNATURE = SignatureConfiguration(signature_methods=frozenset({SignatureMethod.ECDSA_SHA384}),
                                    digest_algorithms=frozenset({DigestAlgorithm.SHA384}), expect_references=1)


def rims_for(files: Mapping[str, bytes], version: str) -> list[tuple[str, bytes]]:
    """The files that claim `version` (colloquialVersion, unverified: it only chooses which files to verify).

    A collateral directory may hold the RIMs of every driver and VBIOS an auditor has met; only the ones a report
    names are verified, so a stale RIM of another version never refuses a report that does not use it.
    """
    chosen = []
    for source, data in sorted(files.items()):
        try:
            meta = etree.fromstring(data, _PARSER).find(f"{SWID}Meta")
        except etree.XMLSyntaxError as exc:
            raise _bad(source, f"is not XML: {exc}") from exc
        if meta is not None and (meta.get("colloquialVersion") or "").lower() == version.lower():
            chosen.append((source, data))
    return chosen


def load_rim(source: str, data: bytes, roots: Sequence[x509.Certificate], now: datetime) -> Rim:
    """Parse and verify one RIM; raises `bad-collateral` (malformed, unsigned, not NVIDIA's) or `expired-collateral`."""
    try:
        document = etree.fromstring(data, _PARSER)
    except etree.XMLSyntaxError as exc:
        raise _bad(source, f"is not XML: {exc}") from exc
    chain = _key_info_chain(source, document)
    try:
        path = verify_chain(chain[0], chain[1:], roots, NVIDIA_SCHEME, now)
    except VerificationError as exc:
        reason = "expired-collateral" if exc.reason == "expired-certificate" else "bad-collateral"
        raise VerificationError(reason, f"{source}'s signing chain: {exc.message}") from exc
    try:
        config = replace(_SIGNATURE, verification_time=now)
        verified = XMLVerifier().verify(document, x509_cert=path[0], expect_config=config)
    except SignXMLException as exc:
        raise _bad(source, f"signature does not verify under {path[0].subject.rfc4514_string()}: {exc}") from exc
    signed = verified.signed_xml if isinstance(verified, VerifyResult) else None
    if signed is None or signed.tag != f"{SWID}SoftwareIdentity":
        raise _bad(source, "signature does not cover the whole SoftwareIdentity document")
    return Rim(source=source, version=_version(source, signed), values=_values(source, signed), signer_path=path)


def select_rim(
    files: Mapping[str, bytes], version: str, what: str, roots: Sequence[x509.Certificate], now: datetime
) -> Rim:
    """The one verified RIM for `version` (`what`: "driver 550.90.07 of GPU 0"); `missing-collateral` when none
    is given, `bad-collateral` when several are or the signed version is not the one the file claimed."""
    matching = rims_for(files, version)
    if not matching:
        raise VerificationError("missing-collateral", f"no RIM file for the {what} (RIM files given: "
                                f"{', '.join(sorted(files))})")
    if len(matching) > 1:
        raise VerificationError("bad-collateral", f"several RIM files for the {what}: "
                                f"{', '.join(source for source, _ in matching)}; keep the one for this board")
    rim = load_rim(*matching[0], roots, now)
    if rim.version != version.lower():
        raise _bad(rim.source, f"signs version {rim.version}, not {version.lower()}")
    return rim


def check_measurements(measurements: Mapping[int, bytes], rims: Sequence[Rim], device: str) -> int:
    """Every active reference value of `rims` must be met by `measurements` (SPDM block index -> value); returns
    how many were compared. Raises `gpu-measurement-mismatch` naming every index that differs or is absent."""
    reference: dict[int, tuple[Rim, ReferenceValue]] = {}
    for rim in rims:
        for value in rim.values:
            if not value.active:
                continue
            if value.index in reference:
                raise VerificationError("bad-collateral", f"RIM index {value.index} is active in both "
                                        f"{reference[value.index][0].source} and {rim.source}")
            reference[value.index] = (rim, value)
    differing = [f"{index} ({value.name}, {rim.source})" for index, (rim, value) in sorted(reference.items())
                 if measurements.get(index + 1) not in value.values]
    if differing:
        raise VerificationError("gpu-measurement-mismatch", f"{device}: measurements at RIM index "
                                f"{', '.join(differing)} differ from NVIDIA's reference values")
    return len(reference)


def _key_info_chain(source: str, document: etree._Element) -> list[x509.Certificate]:
    elements = document.findall(f"{DSIG}Signature/{DSIG}KeyInfo/{DSIG}X509Data/{DSIG}X509Certificate")
    if not elements:
        raise _bad(source, "carries no signature with an X.509 certificate chain: it is not signed")
    try:
        return [x509.load_der_x509_certificate(base64.b64decode("".join((element.text or "").split()), validate=True))
                for element in elements]
    except (ValueError, binascii.Error) as exc:
        raise _bad(source, f"has a signing certificate that does not parse: {exc}") from exc


def _version(source: str, signed: etree._Element) -> str:
    meta = signed.find(f"{SWID}Meta")
    version = None if meta is None else meta.get("colloquialVersion")
    if not version:
        raise _bad(source, "has no Meta colloquialVersion: it names no driver or VBIOS version")
    return version.lower()


def _values(source: str, signed: etree._Element) -> tuple[ReferenceValue, ...]:
    payload = signed.find(f"{SWID}Payload")
    if payload is None:
        raise _bad(source, "has no Payload")
    values: dict[int, ReferenceValue] = {}
    for resource in payload.iterfind(f"{SWID}Resource"):
        try:
            index, size, alternatives = (int(resource.get(name, "")) for name in ("index", "size", "alternatives"))
            hashes = tuple(bytes.fromhex(resource.get(f"{SHA384_HASH}{i}", "")) for i in range(alternatives))
        except ValueError as exc:
            raise _bad(source, f"has a Resource with a bad index, size, alternatives or hash: {exc}") from exc
        active = resource.get("active")
        if active not in ("True", "False") or alternatives < 1 or any(len(value) != size for value in hashes):
            raise _bad(source, f"Resource {index} has active={active!r}, {alternatives} alternatives, "
                       f"hashes of {sorted({len(value) for value in hashes})} bytes for size {size}")
        if index in values:
            raise _bad(source, f"has two Resources at index {index}")
        values[index] = ReferenceValue(index=index, name=resource.get("name", ""), values=hashes,
                                       active=active == "True")
    if not values:
        raise _bad(source, "has no reference measurements")
    return tuple(values[index] for index in sorted(values))


def _bad(source: str, message: str) -> VerificationError:
    return VerificationError("bad-collateral", f"RIM {source} {message}")
