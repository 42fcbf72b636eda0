"""A stand-in for the pynvml module: the CC calls the node makes, answering with pynvml's own structs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pynvml
from nvidia_forge import nvidia_pki, spdm_report


@dataclass
class FakeNvml:
    """`calls` records every NVML call in order; `*_error` make one call raise pynvml's NVMLError."""

    cc_feature: int = 1
    environment: int = 2
    dev_tools: int = 0
    ready: int = 1
    uuids: tuple[str, ...] = ("GPU-11111111-2222-3333-4444-555555555555",)
    init_error: int | None = None
    state_error: int | None = None
    report_error: int | None = None
    calls: list[str] = field(default_factory=list)

    NVMLError = pynvml.NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_CC_SYSTEM_FEATURE_DISABLED = pynvml.NVML_CC_SYSTEM_FEATURE_DISABLED
    NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF = pynvml.NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF
    NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE = pynvml.NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlSystemGetConfComputeState(self) -> pynvml.c_nvmlConfComputeSystemState_t:
        self.calls.append("nvmlSystemGetConfComputeState")
        if self.state_error is not None:
            raise pynvml.NVMLError(self.state_error)
        state = pynvml.c_nvmlConfComputeSystemState_t()
        state.environment, state.ccFeature, state.devToolsMode = self.environment, self.cc_feature, self.dev_tools
        return state

    def nvmlSystemGetConfComputeGpusReadyState(self) -> int:
        self.calls.append("nvmlSystemGetConfComputeGpusReadyState")
        return self.ready

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("nvmlDeviceGetCount")
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.calls.append(f"nvmlDeviceGetHandleByIndex({index})")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self.calls.append(f"nvmlDeviceGetUUID({handle})")
        return self.uuids[handle]

    def nvmlDeviceGetConfComputeGpuAttestationReport(
        self, handle: int, nonce: bytes
    ) -> pynvml.c_nvmlConfComputeGpuAttestationReport_t:
        self.calls.append(f"nvmlDeviceGetConfComputeGpuAttestationReport({handle})")
        if self.report_error is not None:
            raise pynvml.NVMLError(self.report_error)
        assert len(nonce) == pynvml.NVML_CC_GPU_CEC_NONCE_SIZE
        report = pynvml.c_nvmlConfComputeGpuAttestationReport_t()
        report.nonce[:] = list(nonce)
        data = spdm_report(nvidia_pki(), bytes(report.nonce))  # signed by the forged NVIDIA PKI's GPU leaf
        report.attestationReport[: len(data)] = list(data)
        report.attestationReportSize = len(data)
        return report

    def nvmlDeviceGetConfComputeGpuCertificate(self, handle: int) -> pynvml.c_nvmlConfComputeGpuCertificate_t:
        self.calls.append(f"nvmlDeviceGetConfComputeGpuCertificate({handle})")
        certificate = pynvml.c_nvmlConfComputeGpuCertificate_t()
        chain = nvidia_pki().chain_pem()
        certificate.attestationCertChain[: len(chain)] = list(chain)
        certificate.attestationCertChainSize = len(chain)
        return certificate
