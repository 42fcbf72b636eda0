"""A made-up NVIDIA PKI with the real subject names, and GPU reports, RIM files and OCSP responses it signs.

The names come from NVIDIA's own vectors (tests/attestation/vectors/nvtrust/: the Hopper sample's device chain,
the VBIOS sample RIM's signing chain), so the verifier is tested on what real chains look like; only the keys
differ. The OCSP responders are invented: no real NVIDIA OCSP response is public.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from amd_forge import NOW
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from lxml import etree
from signxml import (
    CanonicalizationMethod,
    DigestAlgorithm,
    SignatureConstructionMethod,
    SignatureMethod,
    XMLSigner,
)

from attestation.gpu_verify import TCG_DICE_FWID
from attestation.nvidia_rim import DSIG, SHA384_HASH, SWID

VECTORS = Path(__file__).parent / "vectors" / "nvtrust"
HOPPER_REPORT = bytes.fromhex((VECTORS / "hopperAttestationReport.txt").read_text().strip())
HOPPER_CHAIN = (VECTORS / "hopperCertChain.txt").read_bytes()
SAMPLE_VBIOS_RIM = (VECTORS / "1010_0200_882_96005E0001_PROD.swidtag").read_bytes()
SAMPLE_DRIVER_RIM = (VECTORS / "Driver_RIM_test_no_gpu.swidtag").read_bytes()
DEVICE_ROOT = x509.load_pem_x509_certificate((VECTORS / "verifier_device_root.pem").read_bytes())
RIM_ROOT = x509.load_pem_x509_certificate((VECTORS / "verifier_RIM_root.pem").read_bytes())

DRIVER_VERSION = "550.90.07"
VBIOS_FIELD = bytes.fromhex("009f009601000000")
VBIOS_VERSION = "96.00.9f.00.01"  # how nvtrust reads VBIOS_FIELD; both are the Hopper sample's
FWID = hashlib.sha384(b"forged GSP firmware").digest()
MEASUREMENTS = {index: hashlib.sha384(f"measurement {index}".encode()).digest() for index in range(1, 65)}
"""SPDM block index -> value: 64 SHA-384 values, as a Hopper reports."""
VBIOS_INDICES = range(0, 32)
"""RIM indices the forged VBIOS RIM holds active; the driver RIM holds the rest (0-based: block index - 1)."""
VALID_FROM = NOW - timedelta(days=365)
VALID_TO = NOW + timedelta(days=365)


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


@dataclass(frozen=True)
class NvidiaPki:
    device: tuple[Issued, ...]  # GSP FMC LF (leaf), GSP BROM, Provisioner ICA 1, GH100 Identity, Device Identity CA
    rim: tuple[Issued, ...]  # HCC RIM L4 Signer, Reference Value L3 GH100 001, Reference Value GH100 CA, CoRIM root
    device_responder: Issued  # OCSP responder certified by the device root
    rim_responder: Issued  # OCSP responder certified by the RIM root

    @property
    def device_root(self) -> x509.Certificate:
        return self.device[-1].certificate

    @property
    def rim_root(self) -> x509.Certificate:
        return self.rim[-1].certificate

    def chain_pem(self) -> bytes:
        """The device chain as NVML hands it out: leaf first, root last."""
        return b"".join(issued.certificate.public_bytes(serialization.Encoding.PEM) for issued in self.device)


def make_nvidia_pki() -> NvidiaPki:
    real_device = x509.load_pem_x509_certificates(HOPPER_CHAIN)
    real_rim = _rim_chain(SAMPLE_VBIOS_RIM)
    fwid_extension = real_device[0].extensions.get_extension_for_oid(TCG_DICE_FWID).value
    assert isinstance(fwid_extension, x509.UnrecognizedExtension)
    device = _hierarchy([certificate.subject for certificate in real_device],
                        leaf_extension=x509.UnrecognizedExtension(TCG_DICE_FWID, fwid_extension.value[:-48] + FWID))
    rim = _hierarchy([certificate.subject for certificate in real_rim])
    return NvidiaPki(device=device, rim=rim, device_responder=_responder("NVIDIA Device OCSP Responder", device[-1]),
                     rim_responder=_responder("NVIDIA RIM OCSP Responder", rim[-1]))


@functools.cache
def nvidia_pki() -> NvidiaPki:
    """One PKI per test session: the one fake_nvml signs with and the attestation trust directory trusts."""
    return make_nvidia_pki()


def spdm_report(
    pki: NvidiaPki,
    nonce: bytes,
    measurements: Mapping[int, bytes] = MEASUREMENTS,
    driver_version: str = DRIVER_VERSION,
    fwid: bytes = FWID,
) -> bytes:
    """GET_MEASUREMENTS request || response signed by the leaf; deterministic (RFC 6979) so tests can rebuild it."""
    request = bytes([0x11, 0xE0, 0x01, 0xFF]) + nonce + b"\x00"
    record = b"".join(_block(index, value) for index, value in sorted(measurements.items()))
    opaque = b"".join(_field(kind, value) for kind, value in (
        (3, driver_version.encode() + b"\x00"), (6, VBIOS_FIELD), (15, b"882\x00"), (17, b"1010\x00"),
        (18, b"0200\x00"), (20, fwid)))
    response = (bytes([0x11, 0x60, 0x00, 0x00, len(measurements)]) + len(record).to_bytes(3, "little") + record
                + hashlib.sha256(b"responder nonce" + nonce).digest() + len(opaque).to_bytes(2, "little") + opaque)
    der = pki.device[0].key.sign(request + response, ec.ECDSA(hashes.SHA384(), deterministic_signing=True))
    r, s = decode_dss_signature(der)
    return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")


def rim(pki: NvidiaPki, version: str, values: Mapping[int, bytes], active: Iterable[int]) -> bytes:
    """A swidtag like NVIDIA's, signed by the RIM chain: RIM index i holds `values[i + 1]` (an SPDM block index)."""
    active = set(active)
    namespaces = {None: SWID[1:-1], "ns2": SHA384_HASH[1:].split("}")[0]}
    root = etree.Element(f"{SWID}SoftwareIdentity", nsmap=namespaces,  # type: ignore[arg-type]
                         attrib={"name": "GH100", "tagId": hashlib.sha384(version.encode()).hexdigest(),
                                 "version": "1.0", "corpus": "false", "patch": "false", "supplemental": "false"})
    etree.SubElement(root, f"{SWID}Entity", name="NVIDIA Corporation", role="softwareCreator tagCreator")
    etree.SubElement(root, f"{SWID}Meta", colloquialVersion=version.upper(), product="GH100", edition="GPU")
    payload = etree.SubElement(root, f"{SWID}Payload")
    for index in range(len(values)):
        etree.SubElement(payload, f"{SWID}Resource", attrib={
            "type": "Measurement", "index": str(index), "active": str(index in active), "alternatives": "1",
            "name": f"HashedMeasurement_{index}", "size": "48", f"{SHA384_HASH}0": values[index + 1].hex()})
    signer = XMLSigner(method=SignatureConstructionMethod.enveloped, signature_algorithm=SignatureMethod.ECDSA_SHA384,
                       digest_algorithm=DigestAlgorithm.SHA384, c14n_algorithm=CanonicalizationMethod.CANONICAL_XML_1_1)
    signed = signer.sign(root, key=pki.rim[0].key, cert=[issued.certificate for issued in pki.rim])
    return bytes(etree.tostring(signed))


def rims(pki: NvidiaPki, measurements: Mapping[int, bytes] = MEASUREMENTS) -> dict[str, bytes]:
    """The driver RIM and the VBIOS RIM for the forged report, as collateral files."""
    driver = [index for index in range(len(measurements)) if index not in VBIOS_INDICES]
    return {"driver.swidtag": rim(pki, DRIVER_VERSION, measurements, driver),
            "vbios.swidtag": rim(pki, VBIOS_VERSION, measurements, VBIOS_INDICES)}


def ocsp_response(
    certificate: x509.Certificate, issuer: x509.Certificate, responder: Issued,
    status: ocsp.OCSPCertStatus = ocsp.OCSPCertStatus.GOOD, this_update: datetime = NOW - timedelta(days=1),
) -> bytes:
    revoked = status == ocsp.OCSPCertStatus.REVOKED
    builder = ocsp.OCSPResponseBuilder().add_response(
        cert=certificate, issuer=issuer, algorithm=hashes.SHA384(), cert_status=status, this_update=this_update,
        next_update=this_update + timedelta(days=7), revocation_time=this_update if revoked else None,
        revocation_reason=x509.ReasonFlags.key_compromise if revoked else None,
    ).responder_id(ocsp.OCSPResponderEncoding.HASH, responder.certificate).certificates([responder.certificate])
    return builder.sign(responder.key, hashes.SHA384()).public_bytes(serialization.Encoding.DER)


def ocsp_responses(pki: NvidiaPki, revoked: x509.Certificate | None = None) -> dict[str, bytes]:
    """A good response (or a revoked one for `revoked`) for every certificate the verifier asks about."""
    asked = [(pki.device, position, pki.device_responder) for position in range(1, len(pki.device) - 1)]
    asked += [(pki.rim, position, pki.rim_responder) for position in range(0, len(pki.rim) - 1)]
    return {
        f"{chain[position].certificate.serial_number:x}.der": ocsp_response(
            chain[position].certificate, chain[position + 1].certificate, responder,
            ocsp.OCSPCertStatus.REVOKED if chain[position].certificate == revoked else ocsp.OCSPCertStatus.GOOD)
        for chain, position, responder in asked
    }


def _hierarchy(subjects: list[x509.Name], leaf_extension: x509.ExtensionType | None = None) -> tuple[Issued, ...]:
    """Certificates for `subjects` (leaf first, root last), each signed by the next; the root self-signed."""
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in subjects]
    issued: list[Issued] = []
    for position in reversed(range(len(subjects))):
        issuer = min(position + 1, len(subjects) - 1)
        builder = _builder(subjects[position], subjects[issuer], keys[position].public_key())
        if position > 0:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        elif leaf_extension is not None:
            builder = builder.add_extension(leaf_extension, critical=False)
        issued.insert(0, Issued(keys[position], builder.sign(keys[issuer], hashes.SHA384())))
    return tuple(issued)


def _responder(name: str, issuer: Issued) -> Issued:
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "NVIDIA"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = _builder(subject, issuer.certificate.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.OCSP_SIGNING]), critical=False)
    return Issued(key, builder.sign(issuer.key, hashes.SHA384()))


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key)
            .serial_number(x509.random_serial_number()).not_valid_before(VALID_FROM).not_valid_after(VALID_TO))


def _rim_chain(document: bytes) -> list[x509.Certificate]:
    root = etree.fromstring(document, etree.XMLParser(resolve_entities=False))
    path = f"{DSIG}Signature/{DSIG}KeyInfo/{DSIG}X509Data/{DSIG}X509Certificate"
    return [x509.load_der_x509_certificate(base64.b64decode("".join((element.text or "").split())))
            for element in root.findall(path)]


def _block(index: int, value: bytes) -> bytes:
    dmtf = bytes([0x01]) + len(value).to_bytes(2, "little") + value
    return bytes([index, 0x01]) + len(dmtf).to_bytes(2, "little") + dmtf


def _field(kind: int, value: bytes) -> bytes:
    return kind.to_bytes(2, "little") + len(value).to_bytes(2, "little") + value
