"""Layering: attestation imports only the standard library and `cryptography`; pynvml only by name, when asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.metering.test_imports import non_stdlib

ROOT = Path(__file__).resolve().parents[2]
ATTESTATION_FILES = sorted((ROOT / "attestation").glob("*.py"))


XML_SIGNATURES = {"nvidia_rim.py": {"signxml", "lxml"}}
"""NVIDIA signs RIM files with XML signatures (C14N 1.1), which `cryptography` does not verify alone."""


@pytest.mark.parametrize("path", ATTESTATION_FILES, ids=lambda path: path.name)
def test_attestation_imports_only_stdlib_cryptography_yaml(path: Path) -> None:
    assert non_stdlib(path) <= {"cryptography", "yaml", "attestation"} | XML_SIGNATURES.get(path.name, set())


def test_importing_attestation_loads_no_heavy_package_and_not_pynvml() -> None:
    code = (
        "import sys, attestation.collect, attestation.verify, attestation.cli;"
        "print(sorted(m for m in ('torch', 'aiohttp', 'node', 'cache', 'transformers', 'pynvml') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
