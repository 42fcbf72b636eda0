"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from node.engine.cpu_kernels import CpuKernels, load_kernels


@pytest.fixture(scope="session")
def kernels() -> CpuKernels:
    """The CPU kernels built at install; the test skips, saying why, where this machine cannot run them."""
    found = load_kernels()
    if found.kernels is None:
        pytest.skip(f"no native kernels: {found.reason}")
    return found.kernels
