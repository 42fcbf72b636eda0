"""Offline verification of an evidence document: the entry point for auditors, routers and the CLI.

`verify_evidence` returns a `VerificationResult` listing every check that passed, or raises
`VerificationError` with the reason of the first that failed. Which checks run depends on the
evidence type, through `HARDWARE_VERIFIERS`; `none` evidence has no hardware to check and passes only
when the caller allows it, and then the result says it is untrusted. The binding a report must carry
follows the document's `format` (v1: key and nonce; v2: also TLS, code and models, `attestation.binding`);
the result hands back every bound value, for the caller to hold against its TLS connection and its policy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from attestation.chain import TrustRoots, load_trust_roots
from attestation.checks import Check, CheckSink, Expectations, GpuResult, Platform, SnpGuest, check_nonce
from attestation.collateral import NO_COLLATERAL, Collateral, load_collateral
from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.gpu_verify import verify_gpu
from attestation.snp_verify import verify_snp
from attestation.tdx import verify_tdx

HardwareVerifier = Callable[[Evidence, TrustRoots, Expectations, CheckSink], Platform]
"""Checks one evidence type's report, emitting each passed check; returns what it proved."""

HARDWARE_VERIFIERS: dict[str, HardwareVerifier] = {"sev-snp": verify_snp, "tdx": verify_tdx}


@dataclass(frozen=True, slots=True)
class VerificationResult:
    evidence_type: str
    trusted: bool  # True only for hardware evidence that passed every check; never for `none`
    public_key_hex: str  # the node key the evidence binds: the key that signs its usage records
    boot_id: str
    nonce_hex: str
    nonce_checked: bool  # False when no expected nonce was given: freshness is then unknown
    measurement_hex: str | None  # SNP MEASUREMENT or TDX MRTD; None for `none`
    digest: str  # evidence_digest of the document, as usage records name it
    checks: tuple[Check, ...]  # every check that passed, in order
    binding_version: int  # 1: report_data binds the key and nonce; 2: also the values below
    tls_spki_sha256_hex: str | None  # SHA-256 of the node's TLS SubjectPublicKeyInfo; None: v1, or v2 without TLS
    code_digest_hex: str | None  # the code identity; None for v1
    model_digests: tuple[tuple[str, str], ...]  # (model id, digest hex), ascending by id; empty for v1
    tcb: Mapping[str, int] | None = None  # SEV-SNP REPORTED_TCB's named components (the signing VCEK's); else None
    rtmrs_hex: tuple[str, str, str, str] | None = None  # TDX RTMR0..3; else None
    tcb_status: str | None = None  # TDX: Intel's TCB status of the platform and QE; None: not evaluated (or SNP)
    advisory_ids: tuple[str, ...] = ()  # Intel security advisories the matched TCB levels name
    snp: SnpGuest | None = None  # SEV-SNP guest facts (VMPL, policy, HOST_DATA, key digests, ids); else None
    gpu: GpuResult | None = None  # None: the evidence has no GPU part
    not_checked: tuple[str, ...] = ()  # what the verifier could not check (revocation without CRLs, ...)


def verify_evidence(
    document: Mapping[str, Any] | Evidence,
    trust_roots: TrustRoots | str | os.PathLike[str],
    *,
    expected_nonce: bytes | None = None,
    expected_measurement: bytes | None = None,
    allow_none: bool = False,
    now: datetime | None = None,
    on_check: CheckSink | None = None,
    collateral: Collateral | str | os.PathLike[str] | None = None,
) -> VerificationResult:
    """Verify evidence against the trust roots (a `TrustRoots` or its directory) and vendor collateral (a
    `Collateral` or its directory; without it TCB status and revocation are not evaluated, and the result says so).

    `expected_nonce` is the 32-byte nonce the verifier issued: without it a replayed document passes.
    `on_check` is called with each check as it passes. Raises `VerificationError`.
    """
    evidence = document if isinstance(document, Evidence) else Evidence.from_document(document)
    if collateral is None:
        collateral = NO_COLLATERAL
    elif not isinstance(collateral, Collateral):
        collateral = load_collateral(collateral)
    expect = Expectations(nonce=expected_nonce, measurement=expected_measurement, now=now or datetime.now(UTC),
                          collateral=collateral)
    checks: list[Check] = []

    def emit(check: Check) -> None:
        checks.append(check)
        if on_check is not None:
            on_check(check)

    platform: Platform | None = None
    # Roots are read only when something chains to them: `none` evidence without a GPU part needs none.
    needs_roots = evidence.evidence_type != "none" or evidence.gpu is not None
    roots = trust_roots if isinstance(trust_roots, TrustRoots) else (
        load_trust_roots(trust_roots) if needs_roots else None)
    if evidence.evidence_type == "none":
        if not allow_none:
            raise VerificationError(
                "none-evidence",
                "the node runs without a TEE (evidence type none); nothing binds its key to hardware. "
                "Allow it explicitly (allow_none / --allow-none) to accept it as untrusted",
            )
        emit(Check("evidence", "none: no TEE report; accepted because none evidence was allowed, UNTRUSTED"))
        if evidence.bound is not None:
            emit(Check("key binding", f"none: the node claims {evidence.bound.describe()}; no report binds them"))
    else:
        assert roots is not None
        platform = HARDWARE_VERIFIERS[evidence.evidence_type](evidence, roots, expect, emit)
    emit(check_nonce(evidence, expect.nonce))
    gpu = verify_gpu(evidence, roots, expect, emit)
    bound = evidence.bound
    rtmrs = None if platform is None else platform.rtmrs
    return VerificationResult(
        evidence_type=evidence.evidence_type,
        trusted=evidence.trusted,
        public_key_hex=evidence.public_key.hex(),
        boot_id=evidence.boot_id,
        nonce_hex=evidence.nonce.hex(),
        nonce_checked=expected_nonce is not None,
        measurement_hex=None if platform is None else platform.measurement.hex(),
        digest=evidence.digest(),
        checks=tuple(checks),
        binding_version=1 if bound is None else 2,
        tls_spki_sha256_hex=None if bound is None or bound.tls_spki_sha256 is None else bound.tls_spki_sha256.hex(),
        code_digest_hex=None if bound is None else bound.code_digest.hex(),
        model_digests=() if bound is None else tuple((model.model_id, model.digest.hex()) for model in bound.models),
        tcb=None if platform is None else platform.tcb,
        rtmrs_hex=None if rtmrs is None else (rtmrs[0].hex(), rtmrs[1].hex(), rtmrs[2].hex(), rtmrs[3].hex()),
        tcb_status=None if platform is None else platform.tcb_status,
        advisory_ids=() if platform is None else platform.advisory_ids,
        snp=None if platform is None else platform.snp,
        gpu=gpu,
        not_checked=(() if platform is None else platform.not_checked) + (() if gpu is None else gpu.not_checked),
    )

