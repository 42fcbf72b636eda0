"""NVIDIA GPU confidential computing state and per-GPU attestation reports, read through NVML (pynvml).

Calls, as nvidia-ml-py names them:

    nvmlInit / nvmlShutdown
    nvmlSystemGetConfComputeState()              -> .environment, .ccFeature, .devToolsMode
    nvmlSystemGetConfComputeGpusReadyState()     -> 0 / 1 (GPUs accept client work)
    nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex(i), nvmlDeviceGetUUID(handle)
    nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce[32])
                                                 -> .attestationReport[:.attestationReportSize]
    nvmlDeviceGetConfComputeGpuCertificate(handle)
                                                 -> .attestationCertChain[:.attestationCertChainSize]

The module is a parameter (tests pass a fake with the same calls and structs), and pynvml is imported
by name only when the node asks for it: the package's own imports stay the standard library and
`cryptography`. A GPU report is requested with the binding digest as nonce, so it is bound to the
node key and the verifier nonce like the CPU report is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from attestation.binding import NONCE_BYTES
from attestation.errors import EvidenceUnavailable
from attestation.evidence import GpuDeviceReport, GpuEnvironment, GpuEvidence

NvmlLoader = Callable[[], Any]
"""Returns the pynvml module (or a stand-in with its calls), or None when NVML is not installed."""

ENVIRONMENTS: dict[int, GpuEnvironment] = {0: "unavailable", 1: "sim", 2: "prod"}
"""NVML_CC_SYSTEM_ENVIRONMENT_{UNAVAILABLE, SIM, PROD}; a value a newer driver adds reads "unknown"."""

NO_GPU_ERRORS = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
"""nvmlInit failures that mean "no NVIDIA GPU here" rather than "a GPU we failed to ask"."""
NO_CC_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
"""What a GPU or driver without confidential computing answers to the CC state query."""


def load_pynvml() -> Any:
    """The installed pynvml module (package nvidia-ml-py), or None."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def gpu_evidence(nonce: bytes, nvml: Any) -> GpuEvidence | None:
    """The GPUs' CC state and, with CC on, each GPU's attestation report over `nonce` (32 bytes).

    None when `nvml` is None or finds no NVIDIA driver; raises `EvidenceUnavailable` when NVML is
    there but a CC query fails.
    """
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a GPU attestation nonce is exactly {NONCE_BYTES} bytes, got {len(nonce)}")
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if _is(nvml, exc, NO_GPU_ERRORS):
            return None
        raise EvidenceUnavailable(f"NVML failed to initialise: {exc}") from exc
    try:
        return _read_state(nvml, nonce)
    except nvml.NVMLError as exc:
        raise EvidenceUnavailable(f"NVML confidential computing query failed: {exc}") from exc
    finally:
        nvml.nvmlShutdown()


def _read_state(nvml: Any, nonce: bytes) -> GpuEvidence:
    try:
        state = nvml.nvmlSystemGetConfComputeState()
    except nvml.NVMLError as exc:
        if _is(nvml, exc, NO_CC_ERRORS):
            return GpuEvidence(cc_enabled=False, environment="unavailable", dev_tools=False, ready=None, devices=())
        raise
    environment = ENVIRONMENTS.get(state.environment, "unknown")
    cc_enabled = state.ccFeature != nvml.NVML_CC_SYSTEM_FEATURE_DISABLED
    dev_tools = state.devToolsMode != nvml.NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF
    if not cc_enabled:
        return GpuEvidence(cc_enabled=False, environment=environment, dev_tools=dev_tools, ready=None, devices=())
    ready = nvml.nvmlSystemGetConfComputeGpusReadyState() == nvml.NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE
    devices = tuple(_device_report(nvml, index, nonce) for index in range(nvml.nvmlDeviceGetCount()))
    return GpuEvidence(cc_enabled=True, environment=environment, dev_tools=dev_tools, ready=ready, devices=devices)


def _device_report(nvml: Any, index: int, nonce: bytes) -> GpuDeviceReport:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    report = nvml.nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)
    certificate = nvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    return GpuDeviceReport(
        index=index,
        uuid=uuid.decode("ascii") if isinstance(uuid, bytes) else str(uuid),
        report=bytes(report.attestationReport[: report.attestationReportSize]),
        cert_chain=bytes(certificate.attestationCertChain[: certificate.attestationCertChainSize]),
    )


def _is(nvml: Any, error: Any, names: tuple[str, ...]) -> bool:
    return any(getattr(error, "value", None) == getattr(nvml, name) for name in names)
