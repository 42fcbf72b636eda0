"""Packages are layers: imports go one way (DESIGN.md, STYLE.md principle 2)."""

from __future__ import annotations

import ast
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
