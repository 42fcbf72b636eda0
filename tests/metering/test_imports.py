"""Layering: metering uses only the standard library, cryptography and PyYAML (no torch, aiohttp,
node or cache), and the metering CLI runs without the engine or the server (auditors run it)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METERING_FILES = sorted((ROOT / "metering").glob("*.py"))


def imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def non_stdlib(path: Path) -> set[str]:
    return imported_top_levels(path) - set(sys.stdlib_module_names) - {"__future__"}


@pytest.mark.parametrize("path", METERING_FILES, ids=lambda path: path.name)
def test_metering_imports_only_stdlib_cryptography_yaml(path: Path) -> None:
    assert non_stdlib(path) <= {"cryptography", "yaml", "metering"}


def test_metering_files_found() -> None:
    assert {path.name for path in METERING_FILES} >= {"canonical.py", "ledger.py", "merkle.py", "verify.py"}


def test_cli_metering_runs_without_the_engine_or_the_server() -> None:
    import subprocess

    assert non_stdlib(ROOT / "node" / "cli_metering.py") == {"attestation", "metering", "node"}
    loaded = subprocess.run([sys.executable, "-c", "import sys, node.cli_metering; print(sorted({'torch', "
                             "'transformers', 'aiohttp'} & set(sys.modules)))"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_importing_metering_loads_no_heavy_packages() -> None:
    import subprocess

    code = (
        "import sys, metering.verify, metering.ledger, metering.bill, metering.bench, node.cli_metering;"
        "print(sorted(m for m in ('torch', 'aiohttp', 'cache') if m in sys.modules))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert output.stdout.strip() == "[]"
