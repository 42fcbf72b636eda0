"""Shared fixtures: a small deterministic model built once per test session, and the host staging tensors a test's
sealing made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from node.engine.synthetic import init_model

    return init_model("dense", tmp_path_factory.mktemp("models") / "small", size="small")


@pytest.fixture
def stagings(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every host staging tensor made (`HostCopies.staging`) while the test runs, to read back after use."""
    from cache.device_copy import HostCopies

    made: list[torch.Tensor] = []
    staging = HostCopies.staging

    def recorded(self: HostCopies, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(staging(self, shape, dtype))
        return made[-1]

    monkeypatch.setattr(HostCopies, "staging", recorded)
    return made
