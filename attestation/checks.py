"""The checks every kind of evidence shares (key binding, nonce, measurement) and what verifiers hand back.

A verifier reports each check that passed as a `Check` line, in order, through a callback: a
command-line tool prints them as they pass, so a refusal still shows how far the evidence got.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from attestation.binding import NONCE_BYTES, report_data_for
from attestation.collateral import NO_COLLATERAL, Collateral
from attestation.errors import VerificationError
from attestation.evidence import Evidence

MEASUREMENT_BYTES = 48
"""SEV-SNP MEASUREMENT and TDX MRTD are both SHA-384 digests."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str  # "report signature", "key binding", ...
    detail: str  # what was found, for people

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


CheckSink = Callable[[Check], None]


NOT_CHECKED_SUBJECTS = ("tcb status", "revocation", "gpu measurements", "gpu revocation")
"""What a `not_checked` phrase can be about: the text before its first colon."""


def not_checked_about(phrase: str) -> str:
    """The subject of a `not_checked` phrase (one of `NOT_CHECKED_SUBJECTS`)."""
    subject = phrase.partition(":")[0]
    assert subject in NOT_CHECKED_SUBJECTS, phrase
    return subject


@dataclass(frozen=True, slots=True)
class SnpGuest:
    """What a verified SEV-SNP report says of its guest, for a trust policy to judge."""

    signing_key: str  # "VCEK" or "VLEK"
    product: str | None  # "Milan", "Genoa", "Turin"; None when neither the report nor the chain names it
    vmpl: int
    policy: int  # the guest policy (u64): bit 16 SMT, 18 MIGRATE_MA, 19 DEBUG, 20 SINGLE_SOCKET, ...
    host_data: bytes  # [32]
    id_key_digest: bytes  # [48]
    author_key_digest: bytes  # [48]
    family_id: bytes  # [16]
    image_id: bytes  # [16]


@dataclass(frozen=True, slots=True)
class Platform:
    """What one hardware verifier proved beyond the checks it emitted: the values a trust policy judges."""

    measurement: bytes  # SNP MEASUREMENT or TDX MRTD
    tcb: Mapping[str, int] | None = None  # SEV-SNP REPORTED_TCB's named components
    tcb_status: str | None = None  # TDX: Intel's status (UpToDate, OutOfDate, ...); None: not evaluated
    advisory_ids: tuple[str, ...] = ()  # Intel advisories of the matched TCB levels
    rtmrs: tuple[bytes, bytes, bytes, bytes] | None = None  # TDX RTMR0..3
    snp: SnpGuest | None = None
    not_checked: tuple[str, ...] = ()  # what this verifier could not check, one "subject: why" phrase each


@dataclass(frozen=True, slots=True)
class GpuResult:
    """What the GPU part of the evidence proved."""

    verified: bool  # CC on and every device's chain, SPDM signature and nonce verified
    devices: int  # GPU reports checked
    measurements_checked: bool  # every device's measurements matched NVIDIA's signed reference values
    not_checked: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Expectations:
    """What the verifier requires beyond the hardware's signature."""

    nonce: bytes | None  # the nonce this verifier issued; None skips the freshness check
    measurement: bytes | None  # the expected 48-byte launch measurement; None reports it only
    now: datetime  # certificates must be valid at this time (timezone-aware)
    collateral: Collateral = NO_COLLATERAL  # CRLs, Intel TCB info and QE identity, NVIDIA RIMs and OCSP

    def __post_init__(self) -> None:
        if self.nonce is not None and len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"the expected nonce is exactly {NONCE_BYTES} bytes, got {len(self.nonce)}")
        if self.measurement is not None and len(self.measurement) != MEASUREMENT_BYTES:
            raise ValueError(f"a measurement is {MEASUREMENT_BYTES} bytes, got {len(self.measurement)}")
        if self.now.tzinfo is None:
            raise ValueError("the verification time must be timezone-aware")


def check_key_binding(report_data: bytes, evidence: Evidence) -> Check:
    """The hardware-signed report_data must bind the document's public key, nonce and (v2) bound values.

    report_data is a digest, so a mismatch cannot say which value differs: the message names them all.
    """
    expected = report_data_for(evidence.public_key, evidence.nonce, evidence.bound)
    bound = "" if evidence.bound is None else f", {evidence.bound.describe()}"
    if not hmac.compare_digest(report_data, expected):
        binding, made_for = ("binding", "another key or nonce") if evidence.bound is None else (
            "binding v2", "another key, TLS certificate, code, model set or nonce")
        raise VerificationError(
            "key-binding-mismatch",
            f"report_data is {report_data.hex()}, the {binding} of public key {evidence.public_key.hex()}"
            f"{bound} and nonce {evidence.nonce.hex()} is {expected.hex()}: the report was made for {made_for}",
        )
    return Check("key binding", f"report_data binds public key {evidence.public_key.hex()}{bound} and the nonce")


def check_nonce(evidence: Evidence, expected: bytes | None) -> Check:
    if expected is None:
        return Check("nonce", f"{evidence.nonce.hex()} (not compared: no expected nonce given, freshness unchecked)")
    if not hmac.compare_digest(evidence.nonce, expected):
        raise VerificationError(
            "nonce-mismatch",
            f"the evidence answers nonce {evidence.nonce.hex()}, this verifier issued {expected.hex()}: "
            "the document is stale or replayed",
        )
    return Check("nonce", f"{expected.hex()} matches")


def check_measurement(measurement: bytes, expected: bytes | None, field: str) -> Check:
    if expected is None:
        return Check("measurement", f"{field} {measurement.hex()} (not compared: no expected value given)")
    if not hmac.compare_digest(measurement, expected):
        raise VerificationError(
            "measurement-mismatch", f"{field} is {measurement.hex()}, expected {expected.hex()}"
        )
    return Check("measurement", f"{field} {measurement.hex()} matches")
