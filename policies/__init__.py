"""The node's policy data (YAML), installed with it as package data so that a wheel carries it too."""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent


def policy_file(name: str) -> Path:
    """The shipped policy file `name` (e.g. `pricing.yaml`)."""
    return DIRECTORY / name
