"""`tenzro models init --arch diffusion`: a diffusers directory that loads offline, the same bytes every build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from diffusers import DiffusionPipeline, StableDiffusionPipeline

from node.cli import MEDIA_FAMILIES, build_parser
from node.engine.synthetic import init_model
from node.media.model_dir import is_diffusers_dir
from node.media.synthetic_diffusion import DIFFUSION, TEXT_POSITIONS


def test_the_directory_loads_offline_as_a_stable_diffusion_pipeline(diffusion_dir: Path) -> None:
    assert is_diffusers_dir(diffusion_dir)
    loaded = DiffusionPipeline.from_pretrained(diffusion_dir, local_files_only=True)
    assert isinstance(loaded, StableDiffusionPipeline)
    pipe: Any = loaded  # diffusers' lazy modules give mypy no attributes
    assert pipe.tokenizer.model_max_length == TEXT_POSITIONS
    # A byte-level vocabulary without merges: one token per character (spaces split words), between the start and
    # end tokens.
    assert len(pipe.tokenizer("a cat")["input_ids"]) == len("acat") + 2


def test_models_init_builds_the_same_bytes_every_time_and_refuses_an_existing_directory(
        diffusion_dir: Path, tmp_path: Path) -> None:
    again = init_model(DIFFUSION, tmp_path / "again")
    for weights in sorted(diffusion_dir.rglob("*.safetensors")):
        assert (again / weights.relative_to(diffusion_dir)).read_bytes() == weights.read_bytes()
    with pytest.raises(FileExistsError):
        init_model(DIFFUSION, again)


def test_the_cli_offers_the_architecture() -> None:
    assert MEDIA_FAMILIES == (DIFFUSION,)
    args = build_parser().parse_args(["models", "init", "--arch", "diffusion", "out"])
    assert args.arch == "diffusion"
