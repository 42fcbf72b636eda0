"""Helpers for asserting what a verifier accepts and refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from amd_forge import NONCE, NOW

from attestation.errors import VerificationError
from attestation.evidence import Evidence
from attestation.verify import VerificationResult, verify_evidence


def verified(evidence: Evidence | dict[str, Any], trust_dir: Path, **options: Any) -> VerificationResult:
    return verify_evidence(evidence, trust_dir, **{"expected_nonce": NONCE, "now": NOW, **options})


def refusal(evidence: Evidence | dict[str, Any], trust_dir: Path, **options: Any) -> tuple[str, str]:
    """(reason, message) of the VerificationError the evidence is refused with."""
    with pytest.raises(VerificationError) as refused:
        verified(evidence, trust_dir, **options)
    assert str(refused.value) == f"{refused.value.reason}: {refused.value.message}"
    return refused.value.reason, refused.value.message
