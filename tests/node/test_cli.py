"""The `tenzro` command line's help says what a new user needs: the architectures, the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from node.cli import ARCHITECTURE_CLASSES, MODEL_FAMILIES, build_parser, default_threads
from node.engine.synthetic import ARCHITECTURES, CLASSES, FAMILIES


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width


def test_models_init_help_lists_every_architecture_it_builds(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34: the help named none, so a new user learnt them from the error of a wrong guess."""
    assert (ARCHITECTURE_CLASSES, MODEL_FAMILIES) == (tuple(CLASSES), tuple(FAMILIES))
    text = help_text(capsys, "models", "init")
    assert ("an architecture class: dense, swa, alternating, ssm, hybrid, moe, hybrid-moe (default: dense); or a "
            "model family: llama, mistral, gemma2, gemma3, mixtral, olmoe, qwen2-moe, mamba, mamba2, jamba, bamba, "
            "falcon-h1, granite-moe-hybrid, lfm2, qwen3-next") in text
    assert set(ARCHITECTURES) == {*ARCHITECTURE_CLASSES, *MODEL_FAMILIES}
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["models", "init", "--arch", "transformer", "out"])
    assert refused.value.code == 2
    assert "invalid choice: 'transformer'" in capsys.readouterr().err


def test_node_serve_help_shows_the_threads_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(capsys, "node", "serve")
    assert (f"torch CPU threads (default: one less than the cores this process may use, {default_threads()} here)"
            in text)


def test_the_policy_files_name_commands_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34: the shipped policies told operators to run `tenzro serve`, which is no command."""
    root = Path(__file__).resolve().parents[2] / "policies"
    named = [(path.name, command) for path in sorted([*root.glob("*.yaml"), *root.glob("*.py")])
             for command in re.findall(r"`tenzro ([^`]+)`", path.read_text())]
    assert ("confidential.yaml", "node serve --jurisdiction CC") in named
    for _, command in named:
        assert build_parser().parse_args(command.split()).func is not None
