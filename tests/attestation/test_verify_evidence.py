"""verify_evidence beyond one vendor: `none` evidence, the GPU part, check streaming and the trust directory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from amd_forge import BOOT_ID, NODE_KEY, NONCE, AmdPki, pem
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from fake_nvml import FakeNvml
from verifying import refusal, verified

from attestation.binding import binding_digest
from attestation.checks import Check
from attestation.evidence import Evidence, GpuDeviceReport, GpuEvidence
from attestation.nvml_cc import gpu_evidence

NONE = Evidence(evidence_type="none", source="none", report=b"", aux=b"", gpu=None, public_key=NODE_KEY,
                boot_id=BOOT_ID, nonce=NONCE)


def test_none_evidence_fails_unless_allowed(trust_dir: Path) -> None:
    assert refusal(NONE, trust_dir) == (
        "none-evidence",
        "the node runs without a TEE (evidence type none); nothing binds its key to hardware. Allow it explicitly "
        "(allow_none / --allow-none) to accept it as untrusted",
    )


def test_allowed_none_evidence_is_untrusted_and_needs_no_trust_roots(tmp_path: Path) -> None:
    result = verified(NONE, tmp_path / "absent", allow_none=True)
    assert (result.evidence_type, result.trusted, result.measurement_hex) == ("none", False, None)
    assert [str(check) for check in result.checks] == [
        "evidence: none: no TEE report; accepted because none evidence was allowed, UNTRUSTED",
        f"nonce: {NONCE.hex()} matches",
        "gpu: no GPU evidence (no NVIDIA driver on the node)",
    ]


def test_allowed_none_evidence_still_checks_the_nonce(tmp_path: Path) -> None:
    assert refusal(NONE, tmp_path, allow_none=True, expected_nonce=bytes(32))[0] == "nonce-mismatch"


def test_gpu_reports_bound_to_the_key_and_nonce_pass(trust_dir: Path) -> None:
    gpu = gpu_evidence(binding_digest(NODE_KEY, NONCE), FakeNvml())
    result = verified(replace(NONE, gpu=gpu), trust_dir, allow_none=True)
    assert str(result.checks[-1]) == "gpu: 1 GPU(s) verified"
    assert result.gpu is not None and (result.gpu.verified, result.gpu.devices) == (True, 1)


def test_a_gpu_report_requested_with_another_nonce_fails(trust_dir: Path) -> None:
    gpu = gpu_evidence(bytes(32), FakeNvml(uuids=("GPU-x",)))
    assert refusal(replace(NONE, gpu=gpu), trust_dir, allow_none=True) == (
        "gpu-binding-mismatch",
        f"GPU 0 (GPU-x) report was requested with nonce {bytes(32).hex()}, not the binding digest "
        f"{binding_digest(NODE_KEY, NONCE).hex()}",
    )


def test_a_gpu_with_cc_off_is_reported(tmp_path: Path) -> None:
    gpu = GpuEvidence(cc_enabled=False, environment="unavailable", dev_tools=False, ready=None, devices=())
    result = verified(replace(NONE, gpu=gpu), tmp_path, allow_none=True)
    assert str(result.checks[-1]) == "gpu: confidential computing off (environment unavailable)"


def test_a_truncated_gpu_report_is_refused(tmp_path: Path) -> None:
    device = GpuDeviceReport(index=0, uuid="GPU-x", report=b"\x11\xe0", cert_chain=b"")
    gpu = GpuEvidence(cc_enabled=True, environment="prod", dev_tools=False, ready=True, devices=(device,))
    assert refusal(replace(NONE, gpu=gpu), tmp_path, allow_none=True)[0] == "gpu-truncated-report"


def test_checks_stream_to_the_callback_as_they_pass(tmp_path: Path) -> None:
    seen: list[Check] = []
    result = verified(NONE, tmp_path, allow_none=True, on_check=seen.append)
    assert tuple(seen) == result.checks


def test_checks_that_passed_before_a_failure_were_streamed(trust_dir: Path) -> None:
    seen: list[Check] = []
    refusal(NONE, trust_dir, allow_none=True, expected_nonce=bytes(32), on_check=seen.append)
    assert [check.name for check in seen] == ["evidence"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"expected_nonce": bytes(16)}, "the expected nonce is exactly 32 bytes, got 16"),
        ({"expected_measurement": bytes(32)}, "a measurement is 48 bytes, got 32"),
    ],
)
def test_malformed_expectations_are_caller_errors(tmp_path: Path, options: dict[str, bytes], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        verified(NONE, tmp_path, allow_none=True, **options)
    assert str(refused.value) == message


def test_a_missing_trust_directory_is_named(tmp_path: Path) -> None:
    evidence = replace(NONE, evidence_type="tdx", source="configfs-tsm", report=b"quote")
    assert refusal(evidence, tmp_path / "absent") == (
        "missing-trust-root", f"trust root directory {tmp_path / 'absent'} does not exist"
    )


def test_a_misnamed_trust_root_is_an_error(tmp_path: Path, amd: AmdPki) -> None:
    (tmp_path / "ARK.pem").write_bytes(pem(amd.ark))
    evidence = replace(NONE, evidence_type="tdx", source="configfs-tsm", report=b"quote")
    assert refusal(evidence, tmp_path) == (
        "bad-trust-root", f"unknown files ['ARK.pem'] in {tmp_path}; trust roots are named ark.pem, ask.pem, "
        "intel_root.pem, nvidia_device_root.pem, nvidia_rim_root.pem",
    )


def test_an_ark_that_is_not_self_signed_is_an_error(tmp_path: Path, amd: AmdPki) -> None:
    (tmp_path / "ark.pem").write_bytes(pem(amd.ask))
    evidence = replace(NONE, evidence_type="tdx", source="configfs-tsm", report=b"quote")
    assert refusal(evidence, tmp_path) == (
        "bad-trust-root", f"CN=SEV-Milan in {tmp_path / 'ark.pem'} is not a root self-signed with RSASSA-PSS SHA-384 "
        "salt 48",
    )


def test_an_ark_signed_with_pkcs1_instead_of_pss_is_an_error(tmp_path: Path, amd: AmdPki) -> None:
    pkcs1 = (
        x509.CertificateBuilder().subject_name(amd.ark.subject).issuer_name(amd.ark.subject)
        .public_key(amd.ark_key.public_key()).serial_number(1)
        .not_valid_before(amd.ark.not_valid_before_utc).not_valid_after(amd.ark.not_valid_after_utc)
        .sign(amd.ark_key, hashes.SHA384())
    )
    (tmp_path / "ark.pem").write_bytes(pem(pkcs1))
    evidence = replace(NONE, evidence_type="tdx", source="configfs-tsm", report=b"quote")
    assert refusal(evidence, tmp_path)[0] == "bad-trust-root"
