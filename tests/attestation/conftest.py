"""Fixtures for attestation tests: one made-up AMD and Intel key hierarchy per session, and trust directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from amd_forge import AmdPki, make_amd_pki, make_vcek, pem
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from intel_forge import IntelPki, make_intel_pki
from nvidia_forge import nvidia_pki


@pytest.fixture(scope="session")
def amd() -> AmdPki:
    return make_amd_pki()


@pytest.fixture(scope="session")
def other_amd() -> AmdPki:
    """A second hierarchy with the same names as `amd` and other keys: what a forger can make."""
    return make_amd_pki()


@pytest.fixture(scope="session")
def vcek(amd: AmdPki) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    return make_vcek(amd)


@pytest.fixture(scope="session")
def intel() -> IntelPki:
    return make_intel_pki()


@pytest.fixture(scope="session")
def other_intel() -> IntelPki:
    return make_intel_pki()


@pytest.fixture(scope="session")
def trust_dir(tmp_path_factory: pytest.TempPathFactory, amd: AmdPki, intel: IntelPki) -> Path:
    """ark.pem, intel_root.pem and the NVIDIA roots of fake_nvml's forged GPUs; the ASK comes from the evidence."""
    directory = tmp_path_factory.mktemp("trust")
    (directory / "ark.pem").write_bytes(pem(amd.ark))
    (directory / "intel_root.pem").write_bytes(pem(intel.root))
    (directory / "nvidia_device_root.pem").write_bytes(pem(nvidia_pki().device_root))
    (directory / "nvidia_rim_root.pem").write_bytes(pem(nvidia_pki().rim_root))
    return directory
