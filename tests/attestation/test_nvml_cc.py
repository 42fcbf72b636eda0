"""GPU confidential computing through a stand-in for pynvml: CC off, CC on with reports, NVML absent or failing."""

from __future__ import annotations

import sys

import pynvml
import pytest
from fake_nvml import FakeNvml
from nvidia_forge import nvidia_pki, spdm_report

from attestation import nvml_cc
from attestation.errors import EvidenceUnavailable
from attestation.evidence import GpuDeviceReport, GpuEvidence
from attestation.nvml_cc import gpu_evidence, load_pynvml

NONCE = bytes(range(32))


def test_cc_off_reports_the_state_and_asks_for_no_report() -> None:
    nvml = FakeNvml(cc_feature=0, environment=2)
    assert gpu_evidence(NONCE, nvml) == GpuEvidence(
        cc_enabled=False, environment="prod", dev_tools=False, ready=None, devices=()
    )
    assert nvml.calls == ["nvmlInit", "nvmlSystemGetConfComputeState", "nvmlShutdown"]


def test_cc_on_brings_one_attestation_report_per_gpu_over_the_nonce() -> None:
    nvml = FakeNvml(uuids=("GPU-a", "GPU-b"), dev_tools=1, ready=0)
    evidence = gpu_evidence(NONCE, nvml)
    assert evidence == GpuEvidence(
        cc_enabled=True, environment="prod", dev_tools=True, ready=False,
        devices=tuple(
            GpuDeviceReport(index=index, uuid=uuid, report=spdm_report(nvidia_pki(), NONCE),
                            cert_chain=nvidia_pki().chain_pem())
            for index, uuid in enumerate(("GPU-a", "GPU-b"))
        ),
    )
    assert nvml.calls == [
        "nvmlInit", "nvmlSystemGetConfComputeState", "nvmlSystemGetConfComputeGpusReadyState", "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex(0)", "nvmlDeviceGetConfComputeGpuAttestationReport(0)",
        "nvmlDeviceGetConfComputeGpuCertificate(0)", "nvmlDeviceGetUUID(0)",
        "nvmlDeviceGetHandleByIndex(1)", "nvmlDeviceGetConfComputeGpuAttestationReport(1)",
        "nvmlDeviceGetConfComputeGpuCertificate(1)", "nvmlDeviceGetUUID(1)",
        "nvmlShutdown",
    ]


def test_an_environment_a_newer_driver_adds_reads_unknown() -> None:
    evidence = gpu_evidence(NONCE, FakeNvml(cc_feature=0, environment=7))
    assert evidence is not None and evidence.environment == "unknown"


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_nvidia_library_or_driver_means_no_gpu_part(error: int) -> None:
    nvml = FakeNvml(init_error=error)
    assert gpu_evidence(NONCE, nvml) is None
    assert nvml.calls == ["nvmlInit"]


def test_no_pynvml_module_means_no_gpu_part() -> None:
    assert gpu_evidence(NONCE, None) is None


def test_a_driver_without_cc_reads_as_cc_off() -> None:
    nvml = FakeNvml(state_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert gpu_evidence(NONCE, nvml) == GpuEvidence(
        cc_enabled=False, environment="unavailable", dev_tools=False, ready=None, devices=()
    )


def test_an_nvml_that_fails_otherwise_is_an_error_and_is_shut_down() -> None:
    nvml = FakeNvml(report_error=pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(EvidenceUnavailable, match="NVML confidential computing query failed: GPU is lost"):
        gpu_evidence(NONCE, nvml)
    assert nvml.calls[-1] == "nvmlShutdown"
    with pytest.raises(EvidenceUnavailable, match="NVML failed to initialise: Insufficient Permissions"):
        gpu_evidence(NONCE, FakeNvml(init_error=pynvml.NVML_ERROR_NO_PERMISSION))


def test_the_nonce_is_exactly_32_bytes() -> None:
    with pytest.raises(ValueError, match="exactly 32 bytes, got 31"):
        gpu_evidence(bytes(31), FakeNvml())


def test_the_loader_finds_the_installed_pynvml_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_pynvml() is sys.modules["pynvml"]

    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(nvml_cc.importlib, "import_module", missing)
    assert load_pynvml() is None
