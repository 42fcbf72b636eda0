"""The tiny diffusion pipeline, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.media.synthetic_diffusion import init_diffusion_model


@pytest.fixture(scope="session")
def diffusion_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_diffusion_model(tmp_path_factory.mktemp("diffusion") / "tiny-diffusion")
