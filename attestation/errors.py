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
)


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
