"""Verifying the GPU part of evidence: NVIDIA confidential computing reports, as nvtrust's local verifier does, offline.

Per GPU, in this order, so each refusal names the first thing wrong:

    1. the report parses as SPDM GET_MEASUREMENTS request || signed response   (`attestation.spdm`)
    2. the certificate chain parses and reaches NVIDIA's device root, ECDSA P-384 SHA-384 on every link:
           GH100 A01 GSP FMC LF <- GH100 A01 GSP BROM <- NVIDIA GH100 Provisioner ICA 1
               <- NVIDIA GH100 Identity <- NVIDIA Device Identity CA     (nvidia_device_root.pem)
       and the leaf certifies the firmware (FWID) the report names
    3. the SPDM signature verifies under the leaf; only then is the request's nonce read, and it must be the
       binding digest (a nonce patched into a genuine report breaks the signature first)
    4. measurements against the driver and VBIOS RIM files of the collateral (`attestation.nvidia_rim`)
    5. the certificates nvtrust asks NVIDIA's OCSP responder about (device chain from the BROM up, RIM chains from
       the signer up, never the root) against OCSP response files

Without RIM files or OCSP responses the result says what was not checked. The CC state (on, environment,
devtools) is what NVML told the node, as nvtrust takes it: a GPU outside production or with devtools on is
reported unverified rather than refused, and a trust policy requiring GPUs refuses it.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from attestation import nvidia_rim, ocsp
from attestation.binding import binding_digest
from attestation.chain import (
    NVIDIA_DEVICE_ROOT_FILE,
    NVIDIA_RIM_ROOT_FILE,
    NVIDIA_SCHEME,
    TrustRoots,
    describe,
    describe_path,
    verify_chain,
)
from attestation.checks import Check, CheckSink, Expectations, GpuResult
from attestation.collateral import Collateral
from attestation.errors import VerificationError
from attestation.evidence import Evidence, GpuDeviceReport
from attestation.spdm import SIGNATURE_BYTES, GpuReport, parse_report

TCG_DICE_FWID = x509.ObjectIdentifier("2.23.133.5.4.1")
"""The leaf's DICE TcbInfo extension; on Hopper its last 48 bytes are the firmware digest (nvtrust `extract_fwid`)."""
FWID_BYTES = 48
NO_RIMS = "gpu measurements: no NVIDIA RIM files"
NO_OCSP = "gpu revocation: no OCSP responses"


@dataclass(frozen=True, slots=True)
class DeviceProof:
    """What one GPU's report proved: its chain to NVIDIA's root, and the report the leaf signed."""

    path: tuple[x509.Certificate, ...]  # leaf -> ... -> NVIDIA device root
    report: GpuReport


def verify_gpu(
    evidence: Evidence, roots: TrustRoots | None, expect: Expectations, emit: CheckSink
) -> GpuResult | None:
    """Check the GPU part, emitting each check that passes; None when the evidence has no GPU part.

    `roots` is None only when the evidence has no GPU part and no hardware report (nothing was loaded).
    """
    gpu = evidence.gpu
    if gpu is None:
        emit(Check("gpu", "no GPU evidence (no NVIDIA driver on the node)"))
        return None
    if not gpu.cc_enabled:
        emit(Check("gpu", f"confidential computing off (environment {gpu.environment})"))
        return GpuResult(verified=False, devices=0, measurements_checked=False)
    assert roots is not None, "verify_evidence loads the trust roots for evidence with a GPU part"
    emit(Check("gpu", f"confidential computing on (environment {gpu.environment}, devtools "
                      f"{'on' if gpu.dev_tools else 'off'}, ready {gpu.ready})"))
    digest = binding_digest(evidence.public_key, evidence.nonce, evidence.bound)
    proofs = []
    for device in gpu.devices:
        proof = verify_device(device, roots, digest, expect.now)
        signers = describe_path(proof.path, NVIDIA_SCHEME)
        emit(Check("gpu report", f"{_name(device)}: SPDM measurements signed by {signers}, requested with the "
                                 "binding digest"))
        proofs.append(proof)
    collateral = expect.collateral
    rims = _check_measurements(gpu.devices, proofs, roots, collateral, expect.now, emit)
    not_checked = (() if rims else (NO_RIMS,)) + _check_revocation(proofs, rims, collateral, expect.now, emit)
    refusals = []
    if gpu.environment != "prod":
        refusals.append(f"environment {gpu.environment} is not production")
    if gpu.dev_tools:
        refusals.append("devtools mode is on, so a debugger can read GPU memory")
    if not gpu.devices:
        refusals.append("confidential computing is on but the node brought no GPU report")
    verified = not refusals
    emit(Check("gpu", f"{len(proofs)} GPU(s) verified" if verified else f"NOT verified: {'; '.join(refusals)}"))
    return GpuResult(verified=verified, devices=len(proofs), measurements_checked=bool(rims),
                     not_checked=not_checked)


def verify_device(device: GpuDeviceReport, roots: TrustRoots, nonce: bytes, now: datetime) -> DeviceProof:
    """Steps 1 to 3 for one GPU: the report's structure, its chain to NVIDIA's device root, the SPDM signature under
    the leaf, then the requested nonce. Raises `VerificationError`."""
    report = parse_report(device.report)
    certificates = _certificates(device)
    try:
        path = verify_chain(certificates[0], certificates[1:], roots.roots_in(NVIDIA_DEVICE_ROOT_FILE, "GPU"),
                            NVIDIA_SCHEME, now)
    except VerificationError as exc:
        if exc.reason != "untrusted-chain":
            raise
        raise VerificationError("gpu-untrusted-chain", f"{_name(device)}: {exc.message}") from exc
    _check_fwid(device, path[0], report)
    _check_signature(device, path[0], report)
    if not hmac.compare_digest(report.request_nonce, nonce):
        raise VerificationError(
            "gpu-binding-mismatch",
            f"{_name(device)} report was requested with nonce {report.request_nonce.hex()}, not the binding digest "
            f"{nonce.hex()}",
        )
    return DeviceProof(path=path, report=report)


def _certificates(device: GpuDeviceReport) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(device.cert_chain)
    except ValueError as exc:
        raise VerificationError("gpu-bad-certificate",
                                f"{_name(device)}'s certificate chain is not PEM certificates: {exc}") from exc
    key = certificates[0].public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise VerificationError("gpu-bad-certificate", f"{_name(device)}'s leaf {describe(certificates[0])} does not "
                                "hold an EC P-384 key, so it cannot have signed an SPDM report")
    return certificates


def _check_fwid(device: GpuDeviceReport, leaf: x509.Certificate, report: GpuReport) -> None:
    """The leaf's key belongs to the firmware it certifies; a report naming other firmware was not made by it."""
    if report.fwid is None:
        return
    try:
        extension = leaf.extensions.get_extension_for_oid(TCG_DICE_FWID).value
    except x509.ExtensionNotFound:
        extension = None
    certified = extension.value[-FWID_BYTES:] if isinstance(extension, x509.UnrecognizedExtension) else None
    if certified is None or not hmac.compare_digest(certified, report.fwid):
        raise VerificationError(
            "gpu-untrusted-chain", f"{_name(device)}'s report names firmware {report.fwid.hex()}, its leaf "
            f"{describe(leaf)} certifies {certified.hex() if certified else 'no firmware'}")


def _check_signature(device: GpuDeviceReport, leaf: x509.Certificate, report: GpuReport) -> None:
    key = leaf.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey), "_certificates admits EC P-384 leaves only"
    half = SIGNATURE_BYTES // 2
    signature = encode_dss_signature(int.from_bytes(report.signature[:half], "big"),
                                     int.from_bytes(report.signature[half:], "big"))
    try:
        key.verify(signature, report.signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature as exc:
        raise VerificationError(
            "gpu-bad-signature", f"{_name(device)}'s SPDM signature does not verify under its leaf {describe(leaf)}: "
            "the report was altered or signed by another GPU") from exc


def _check_measurements(
    devices: Sequence[GpuDeviceReport], proofs: Sequence[DeviceProof], roots: TrustRoots, collateral: Collateral,
    now: datetime, emit: CheckSink,
) -> tuple[nvidia_rim.Rim, ...]:
    """Step 4; the RIMs the measurements were compared with, none when the collateral has no RIM files."""
    if not collateral.nvidia_rims:
        emit(Check("gpu measurements", "not checked: the collateral has no NVIDIA RIM files"))
        return ()
    rim_roots = roots.roots_in(NVIDIA_RIM_ROOT_FILE, "GPU RIM")
    verified: dict[str, nvidia_rim.Rim] = {}
    """Version -> its RIM, verified once: the GPUs of one machine mostly share their driver and VBIOS."""
    for device, proof in zip(devices, proofs, strict=True):
        chosen = []
        for kind, version in (("driver", proof.report.driver_version), ("VBIOS", proof.report.vbios_version)):
            if version is None:
                raise VerificationError("gpu-malformed-report", f"{_name(device)}'s report names no {kind} version, "
                                        "so no RIM can be chosen for it")
            if version.lower() not in verified:
                verified[version.lower()] = nvidia_rim.select_rim(
                    collateral.nvidia_rims, version, f"{kind} {version} of {_name(device)}", rim_roots, now)
            chosen.append(verified[version.lower()])
        compared = nvidia_rim.check_measurements(proof.report.measurements, chosen, _name(device))
        emit(Check("gpu measurements", f"{_name(device)}: {compared} measurements match NVIDIA's reference values in "
                                       + " and ".join(f"{rim.source} ({rim.version})" for rim in chosen)))
    return tuple(verified.values())


def _check_revocation(
    proofs: Sequence[DeviceProof], rims: Sequence[nvidia_rim.Rim], collateral: Collateral, now: datetime,
    emit: CheckSink,
) -> tuple[str, ...]:
    """Step 5, on the certificates nvtrust asks NVIDIA's responder about: a device chain's from the BROM up (the
    leaf is made by the GPU's firmware at each boot, no responder knows it) and a RIM chain's from its signer up;
    never a root, which has no issuer to answer for it. Returns what could not be checked."""
    if not collateral.nvidia_ocsp:
        emit(Check("gpu revocation", "not checked: the collateral has no OCSP responses"))
        return (NO_OCSP,)
    responses = ocsp.load_responses(collateral.nvidia_ocsp)
    pending: dict[x509.Certificate, tuple[x509.Certificate, ...]] = {}
    paths = [(proof.path, 1) for proof in proofs] + [(rim.signer_path, 0) for rim in rims]
    for path, first in paths:
        for position in range(first, len(path) - 1):
            pending.setdefault(path[position], path[position + 1:])
    sources = {certificate: ocsp.check_status(certificate, above, responses, NVIDIA_SCHEME, now)
               for certificate, above in pending.items()}
    good = [f"{describe(certificate)} ({source})" for certificate, source in sources.items() if source is not None]
    unanswered = [describe(certificate) for certificate, source in sources.items() if source is None]
    if good:
        emit(Check("gpu revocation", "good: " + ", ".join(good)))
    return (f"gpu revocation: no OCSP response for {', '.join(unanswered)}",) if unanswered else ()


def _name(device: GpuDeviceReport) -> str:
    return f"GPU {device.index} ({device.uuid})"
