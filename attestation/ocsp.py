"""OCSP responses given as files: whether a certificate on a verified path is revoked, offline.

NVIDIA publishes revocation of its GPU and RIM certificates only through OCSP (nvtrust asks
ocsp.ndis.nvidia.com for every certificate between the leaf and the root). Verification never touches
the network, so the responses come as DER files (`nvidia/ocsp/*.der` in the collateral directory); a
response counts only when it names the certificate (serial and issuer hashes), is signed by the issuer or
by a responder certificate carrying id-kp-OCSPSigning that a certificate at or above the issuer on the
verified path signed (nvtrust accepts a responder anywhere above the certificate too), and is current.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

from attestation.chain import SignatureScheme, describe
from attestation.errors import VerificationError


@dataclass(frozen=True, slots=True)
class OcspFile:
    source: str  # the file name, for messages
    response: ocsp.OCSPResponse  # a SUCCESSFUL response


def load_responses(files: Mapping[str, bytes]) -> tuple[OcspFile, ...]:
    """Parse every file; `bad-collateral` for one that is not a DER OCSP response or reports no success."""
    loaded = []
    for source, data in sorted(files.items()):
        try:
            response = ocsp.load_der_ocsp_response(data)
        except ValueError as exc:
            raise VerificationError("bad-collateral", f"{source} is not a DER OCSP response: {exc}") from exc
        if response.response_status != ocsp.OCSPResponseStatus.SUCCESSFUL:
            raise VerificationError("bad-collateral", f"{source} is an OCSP {response.response_status.name} "
                                    "response, which says nothing about any certificate")
        loaded.append(OcspFile(source, response))
    return tuple(loaded)


def check_status(
    certificate: x509.Certificate,
    above: Sequence[x509.Certificate],
    responses: Sequence[OcspFile],
    scheme: SignatureScheme,
    now: datetime,
) -> str | None:
    """The source of the response that says `certificate` is good, or None when no response names it.

    `above` is the verified path above `certificate`: its issuer first, the root last. Raises `revoked`, or
    `bad-collateral` for a response that names the certificate but is not signed as it must be or says unknown,
    or `expired-collateral` for one that is not current at `now`.
    """
    issuer = above[0]
    for file in responses:
        for single in file.response.responses:
            if not _names(single, certificate, issuer):
                continue
            _check_signer(file, issuer, above, scheme, now)
            if not single.this_update_utc <= now or (
                    single.next_update_utc is not None and now > single.next_update_utc):
                until = single.next_update_utc.isoformat() if single.next_update_utc else "no next update"
                raise VerificationError("expired-collateral", f"{file.source} is current from "
                                        f"{single.this_update_utc.isoformat()} to {until}, not at {now.isoformat()}")
            if single.certificate_status == ocsp.OCSPCertStatus.REVOKED:
                revoked_at = single.revocation_time_utc.isoformat() if single.revocation_time_utc else "unknown time"
                reason = single.revocation_reason.name if single.revocation_reason else "no reason given"
                raise VerificationError("revoked", f"{describe(certificate)} (serial {certificate.serial_number:#x}) "
                                        f"is revoked since {revoked_at} ({reason}), says {file.source}")
            if single.certificate_status != ocsp.OCSPCertStatus.GOOD:
                raise VerificationError("bad-collateral", f"{file.source} says the status of {describe(certificate)} "
                                        "is unknown to its responder")
            return file.source
    return None


def _names(single: ocsp.OCSPSingleResponse, certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    if single.serial_number != certificate.serial_number:
        return False
    try:
        request = ocsp.OCSPRequestBuilder().add_certificate(certificate, issuer, single.hash_algorithm).build()
    except (ValueError, TypeError):
        return False
    return (request.issuer_name_hash, request.issuer_key_hash) == (single.issuer_name_hash, single.issuer_key_hash)


def _check_signer(
    file: OcspFile, issuer: x509.Certificate, above: Sequence[x509.Certificate], scheme: SignatureScheme,
    now: datetime,
) -> None:
    if _signed_by(file.response, issuer):
        return
    for responder in file.response.certificates:
        if not any(responder.issuer == signer.subject and scheme.verifies(responder, signer) for signer in above):
            continue
        if not responder.not_valid_before_utc <= now <= responder.not_valid_after_utc:
            continue
        try:
            usages = responder.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            continue
        if ExtendedKeyUsageOID.OCSP_SIGNING in usages and _signed_by(file.response, responder):
            return
    raise VerificationError(
        "bad-collateral", f"{file.source} is signed neither by {describe(issuer)} nor by an OCSP responder "
        "certificate (id-kp-OCSPSigning, valid now) that the verified path issued")


def _signed_by(response: ocsp.OCSPResponse, signer: x509.Certificate) -> bool:
    key = signer.public_key()
    algorithm = response.signature_hash_algorithm
    if not isinstance(key, ec.EllipticCurvePublicKey) or algorithm is None:
        return False
    try:
        key.verify(response.signature, response.tbs_response_bytes, ec.ECDSA(algorithm))
    except (InvalidSignature, UnsupportedAlgorithm):
        return False
    return True
