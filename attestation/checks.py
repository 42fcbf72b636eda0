"""The checks every kind of evidence shares: key binding, nonce, measurement and the GPU part.

A verifier reports each check that passed as a `Check` line, in order, through a callback: a
command-line tool prints them as they pass, so a refusal still shows how far the evidence got.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from attestation.binding import NONCE_BYTES, binding_digest, report_data_for
from attestation.errors import VerificationError
from attestation.evidence import Evidence

MEASUREMENT_BYTES = 48
"""SEV-SNP MEASUREMENT and TDX MRTD are both SHA-384 digests."""
SPDM_REQUEST_NONCE = slice(4, 36)
"""The nonce in a GPU report's SPDM GET_MEASUREMENTS request (NVIDIA nvtrust)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str  # "report signature", "key binding", ...
    detail: str  # what was found, for people

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


CheckSink = Callable[[Check], None]


@dataclass(frozen=True, slots=True)
class Expectations:
    """What the verifier requires beyond the hardware's signature."""

    nonce: bytes | None  # the nonce this verifier issued; None skips the freshness check
    measurement: bytes | None  # the expected 48-byte launch measurement; None reports it only
    now: datetime  # certificates must be valid at this time (timezone-aware)

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


def check_gpu(evidence: Evidence) -> Check:
    """Every GPU report must have been requested with the binding digest as its nonce.

    The SPDM signature over each report and its measurements against NVIDIA's reference values are
    not checked here, and the CC state fields are the node's claims; the check line says so.
    """
    gpu = evidence.gpu
    if gpu is None:
        return Check("gpu", "no GPU evidence (no NVIDIA driver on the node)")
    if not gpu.cc_enabled:
        return Check("gpu", f"confidential computing off (environment {gpu.environment})")
    digest = binding_digest(evidence.public_key, evidence.nonce, evidence.bound)
    for device in gpu.devices:
        requested = device.report[SPDM_REQUEST_NONCE]
        if not hmac.compare_digest(requested, digest):
            raise VerificationError(
                "gpu-binding-mismatch",
                f"GPU {device.index} ({device.uuid}) report was requested with nonce {requested.hex()}, "
                f"not the binding digest {digest.hex()}",
            )
    return Check(
        "gpu",
        f"confidential computing on (environment {gpu.environment}, devtools {'on' if gpu.dev_tools else 'off'}, "
        f"ready {gpu.ready}); {len(gpu.devices)} GPU report(s) bound to the key and nonce; "
        "their SPDM signatures and measurements are not verified here",
    )
