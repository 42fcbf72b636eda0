"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from node.engine.cpu_kernels import CpuKernels, load_kernels


@pytest.fixture(scope="session")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The CPU kernels, built once per session into a temporary directory."""
    built = load_kernels(tmp_path_factory.mktemp("kernels"))
    if built is None:
        pytest.skip("this machine has no AVX-512 or no C++ compiler: the engine runs transformers' forward")
    return built
