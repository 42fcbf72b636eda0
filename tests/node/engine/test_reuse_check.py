"""The load-time check turns reuse off for a model whose continuation is wrong, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.engine import forward
from node.engine.loader import load_model
from node.engine.reuse_check import check_reuse
from node.engine.synthetic import init_model


def test_models_that_continue_exactly_keep_reuse(small_model_dir: Path, tmp_path: Path) -> None:
    for loaded in (load_model("small", small_model_dir), load_model("m", init_model("mamba", tmp_path / "m", "small"))):
        assert loaded.state is not None and loaded.reuse_blocker is None
        result = check_reuse(loaded.forward.prefill, loaded.state, 32000, loaded.dtype)
        assert result.passed and result.relative_difference < 1e-5


def test_a_model_whose_continuation_restarts_from_zero_is_served_without_reuse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = init_model("mamba", tmp_path / "m", "small")
    monkeypatch.setattr(forward.mamba1, "install", lambda model: 0)  # the upstream torch path, as shipped
    loaded = load_model("m", directory)
    assert loaded.state is None
    assert loaded.reuse_blocker is not None and "differs from one pass" in loaded.reuse_blocker
