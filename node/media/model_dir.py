"""Which model directories hold an image pipeline: a diffusers directory names its components in
`model_index.json`. Apart from the pipeline's module so that a text node's start imports no diffusers."""

from __future__ import annotations

from pathlib import Path

MODEL_INDEX = "model_index.json"


def is_diffusers_dir(path: Path) -> bool:
    return (path / MODEL_INDEX).is_file()
