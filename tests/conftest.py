"""Shared fixtures: a small deterministic model built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from node.engine.synthetic import init_model

    return init_model("dense", tmp_path_factory.mktemp("models") / "small", size="small")
