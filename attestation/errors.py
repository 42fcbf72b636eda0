"""The typed failures of attestation: unavailable evidence, malformed documents, and verification reasons.

A verifier's caller (an auditor's script, the router) acts on *why* evidence was refused, so every
refusal carries one reason code from `REASONS` beside a message for people. Codes are part of the
interface: they are never renamed, only added.
"""

from __future__ import annotations

REASONS: tuple[str, ...] = (
    "malformed-document",  # the evidence document is not a valid tenzro evidence document
    "none-evidence",  # the evidence is of type `none` and the verifier did not allow it
    "truncated-report",  # the report or quote is shorter than its structure
    "malformed-report",  # the report or quote has the right size but a field that breaks its format
    "unsupported-report",  # a version, algorithm, TEE type or signing key this verifier does not handle
    "missing-certificate",  # the evidence lacks a certificate the chain needs (the VCEK, the PCK chain)
    "bad-certificate",  # a certificate does not parse, has the wrong key type or lacks a required extension
    "missing-trust-root",  # the trust root directory lacks the root this evidence needs, or is unreadable
    "bad-trust-root",  # a trust root file is unreadable, misnamed, or not a self-signed root of its vendor
    "untrusted-chain",  # a certificate in the chain is not signed by its issuer, up to a trusted root
    "expired-certificate",  # a certificate in the chain is not valid at the verification time
    "bad-report-signature",  # the SNP report or TDX quote signature does not verify
    "bad-qe-signature",  # the TDX quoting enclave report is not signed by the PCK certificate
    "qe-binding-mismatch",  # the quoting enclave report does not bind the quote's attestation key
    "tcb-mismatch",  # the report's TCB disagrees with the VCEK, or runs below it, or is provisional
    "chip-id-mismatch",  # the report's CHIP_ID is not the VCEK's hardware id
    "debug-enabled",  # the guest runs with debugging allowed, so its memory is readable by the host
    "measurement-mismatch",  # the launch measurement is not the expected one
    "key-binding-mismatch",  # report_data is not the binding of the document's public key and nonce
    "nonce-mismatch",  # the document's nonce is not the verifier's nonce (a stale or replayed document)
    "gpu-binding-mismatch",  # a GPU attestation report was not requested with the binding digest as nonce
    "revoked",  # a certificate on the path is named on its issuer's CRL (or a GPU OCSP response says revoked)
    "missing-collateral",  # the collateral directory lacks what this evidence needs (Intel TCB info for its FMSPC...)
    "bad-collateral",  # collateral (TCB info, QE identity, CRL, RIM, OCSP) is malformed or not signed to a trusted root
    "expired-collateral",  # collateral is outside its issue/next-update window at the verification time
    "qe-identity-mismatch",  # the TDX quoting enclave is not the one Intel's signed QE identity describes
    "tcb-level-not-found",  # no TCB level in the vendor's signed TCB info matches the platform
    "tdx-module-mismatch",  # the TD's MRSIGNERSEAM or SEAM attributes are not the TDX module Intel's TCB info names
    "gpu-truncated-report",  # a GPU report is shorter than its SPDM request and response
    "gpu-malformed-report",  # a GPU report's SPDM messages break their format
    "gpu-bad-certificate",  # a GPU attestation certificate chain does not parse or lacks its leaf
    "gpu-untrusted-chain",  # a GPU certificate chain does not reach NVIDIA's device root
    "gpu-bad-signature",  # a GPU report's SPDM signature does not verify under the chain's leaf
    "gpu-measurement-mismatch",  # a GPU measurement differs from the reference value of NVIDIA's signed RIM
)


POLICY_REASONS: tuple[str, ...] = (
    "tee-type-not-accepted",  # the evidence type is not one the trust policy's tee_types lists
    "workload-not-accepted",  # the launch measurement (SNP MEASUREMENT, TDX MRTD) or TDX RTMRs are not pinned values
    "tcb-below-minimum",  # an SEV-SNP TCB component is below the policy's min_tcb, or the evidence presents no TCB
    "tcb-status-not-accepted",  # the TDX TCB status is not one the policy accepts, or was not evaluated
    "guest-policy-not-accepted",  # SEV-SNP VMPL, guest policy bits, HOST_DATA, ID/author key or family/image ids
    "code-not-accepted",  # the bound code digest is not one the policy accepts
    "model-not-accepted",  # a served model's weight digest is not one the policy accepts
    "gpu-missing",  # the policy requires verified GPU evidence and the node presented none (or CC off)
    "revocation-not-checked",  # the policy requires revocation checks and the collateral did not allow them
    "channel-not-attested",  # the TLS key the caller connected to is not the one the evidence binds (or none is bound)
)
"""Why a trust policy refuses evidence that verified: `Verdict.refusals` carry one of these each."""


class AttestationError(Exception):
    """Base of the errors this package raises."""


class EvidenceUnavailable(AttestationError):
    """A TEE interface is present but did not produce evidence; never answered with `none` evidence.

    Falling back to `none` here would turn a failing confidential machine into an untrusted one
    without anyone deciding so; the node refuses to serve instead.
    """


class MalformedEvidence(AttestationError, ValueError):
    """An `Evidence` value or document field is invalid; the message names the field."""


class VerificationError(AttestationError):
    """Evidence was refused; `reason` is one of `REASONS`, `message` says what was found."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
