"""Packages are layers: imports go one way (DESIGN.md, STYLE.md principle 2)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "metering": {"torch", "aiohttp", "node", "cache", "transformers"},
    "attestation": {"torch", "aiohttp", "node", "cache", "transformers"},
    "cache": {"aiohttp", "node"},
    "policies": {"torch", "aiohttp", "node", "cache", "metering", "transformers"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
        if imported_roots(path) & FORBIDDEN[package]
    }
    assert offenders == {}


METADATA_ONLY = ("cache/scope.py", "cache/budget.py", "cache/radix_tree.py", "cache/prefix_cache.py",
                 "cache/sealing.py")
"""The prefix index decides on metadata only: it cannot touch a tensor (issue 11, DESIGN.md)."""


@pytest.mark.parametrize("module", METADATA_ONLY)
def test_the_prefix_index_imports_no_tensor_library(module: str) -> None:
    assert imported_roots(ROOT / module) & {"torch", "transformers", "numpy"} == set()
    name = module.removesuffix(".py").replace("/", ".")
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {name}; print('torch' in sys.modules)"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"  # not even through what it imports
