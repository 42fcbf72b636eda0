"""Verifying the GPU part of evidence: NVIDIA confidential computing reports (issue 36 extends this).

Every GPU report must have been requested with the binding digest as its nonce.
"""

from __future__ import annotations

import hmac

from attestation.binding import binding_digest
from attestation.chain import TrustRoots
from attestation.checks import Check, CheckSink, Expectations, GpuResult
from attestation.errors import VerificationError
from attestation.evidence import Evidence

SPDM_REQUEST_NONCE = slice(4, 36)
"""The nonce in a GPU report's SPDM GET_MEASUREMENTS request (NVIDIA nvtrust)."""


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
    digest = binding_digest(evidence.public_key, evidence.nonce, evidence.bound)
    for device in gpu.devices:
        requested = device.report[SPDM_REQUEST_NONCE]
        if not hmac.compare_digest(requested, digest):
            raise VerificationError(
                "gpu-binding-mismatch",
                f"GPU {device.index} ({device.uuid}) report was requested with nonce {requested.hex()}, "
                f"not the binding digest {digest.hex()}",
            )
    emit(Check(
        "gpu",
        f"confidential computing on (environment {gpu.environment}, devtools {'on' if gpu.dev_tools else 'off'}, "
        f"ready {gpu.ready}); {len(gpu.devices)} GPU report(s) bound to the key and nonce; "
        "their SPDM signatures and measurements are not verified here",
    ))
    return GpuResult(verified=False, devices=len(gpu.devices), measurements_checked=False,
                     not_checked=("gpu: SPDM signatures, certificate chains and measurements",))
