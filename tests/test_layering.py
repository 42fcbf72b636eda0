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
    "bench": {"node", "router", "metering", "attestation"},  # a client of a node: HTTP and the `tenzro` command
    # The router verifies its providers itself (issue 35): the caller's verifier (`client`) and the trust policy.
    "router": {"torch", "node", "transformers", "metering"},
    "client": {"torch", "node", "cache", "transformers", "metering", "router", "bench"},  # a caller: the verifier only
}


ALLOWED = {
    "bench/agent.py": {
        "node.engine.synthetic": "the agent workload's text comes from `training_corpus`, the corpus the embedded "
                                 "models' tokenizer was trained on, so its chats have the token counts a caller of "
                                 "those models sends; no `tenzro` command prints that corpus",
    },
}
"""The imports a FORBIDDEN rule lets through, per file, each with the reason no subprocess or HTTP call serves."""


def imported_roots(path: Path) -> set[str]:
    allowed = ALLOWED.get(str(path.relative_to(ROOT)), {})
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names if alias.name not in allowed)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module not in allowed:
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


@pytest.mark.parametrize("path", sorted(ALLOWED))
def test_every_allowed_import_is_still_made(path: str) -> None:
    modules = {node.module for node in ast.walk(ast.parse((ROOT / path).read_text()))
               if isinstance(node, ast.ImportFrom)}
    assert set(ALLOWED[path]) <= modules


def test_the_bench_commands_load_no_node_module() -> None:
    """The one allowed import is made when a workload is built, not when `tenzro bench` builds its parsers."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, bench.reuse, bench.seal, bench.agent, bench.scenarios, "
                             "bench.load, bench.route, bench.hostile; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'node'))"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


METADATA_ONLY = ("cache/scope.py", "cache/budget.py", "cache/radix_tree.py", "cache/prefix_cache.py",
                 "cache/sealing.py", "cache/summary.py")
"""The prefix index decides on metadata only: it cannot touch a tensor (issue 11, DESIGN.md)."""


@pytest.mark.parametrize("module", METADATA_ONLY)
def test_the_prefix_index_imports_no_tensor_library(module: str) -> None:
    assert imported_roots(ROOT / module) & {"torch", "transformers", "numpy"} == set()
    name = module.removesuffix(".py").replace("/", ".")
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {name}; print('torch' in sys.modules)"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"  # not even through what it imports


def test_the_router_reads_summaries_and_nothing_else_of_the_cache() -> None:
    """cache.summary is pure; the rest of `cache` owns tensors and state the router has no business holding."""
    modules = {
        (str(path.relative_to(ROOT)), name)
        for path in (ROOT / "router").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        for name in ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
    }
    from_cache = {(path, name) for path, name in modules if name.split(".")[0] == "cache" and name != "cache.summary"}
    assert from_cache == set()
    loaded = subprocess.run([sys.executable, "-c", "import sys, router.app, router.cli; print('torch' in sys.modules)"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


INSIDE_NODE = {
    "node/engine": {"node.api", "node.service", "node.cli"},
    "node/service.py": {"node.api", "node.cli"},
}
"""Layers inside `node` (issue 37): the engine runs models for the service, which the HTTP layer calls; neither
reaches up. A folder or file, and the modules (with their submodules) it never imports."""
SCRIPT_USERS = ("node", "cache", "metering", "attestation", "policies", "bench", "router", "client", "tests")
"""Everything that could import a script: none may. A script is a command run by its path (tests run them so)."""


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports, `from X import Y` counted as both X and X.Y (Y may be a module);
    imports under `TYPE_CHECKING` count too: they are the layering a reader sees."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def python_files(where: str) -> list[Path]:
    path = ROOT / where
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


@pytest.mark.parametrize("where", sorted(INSIDE_NODE))
def test_layers_inside_node_import_one_way(where: str) -> None:
    above = INSIDE_NODE[where]
    offenders = {
        str(path.relative_to(ROOT)): sorted(name for name in imported_modules(path)
                                            if any(name == up or name.startswith(up + ".") for up in above))
        for path in python_files(where)
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_engine_loads_no_module_above_it() -> None:
    """Not even through what it imports: every engine module imported, nothing of the service, api or CLI loaded."""
    names = ", ".join(str(path.relative_to(ROOT)).removesuffix(".py").replace("/", ".")
                      for path in python_files("node/engine") if path.name != "__init__.py")
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {names}; print(sorted(m for m in sys.modules "
                             "if m.startswith(('node.api', 'node.service', 'node.cli'))))"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_no_script_imports_another() -> None:
    """Scripts may import any package of the project (they measure its internals on purpose), but no other script:
    `python scripts/x.py` puts scripts/ first on the path, so a sibling would be importable by its bare name."""
    siblings = {path.stem for path in python_files("scripts")} | {"scripts"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(name for name in imported_modules(path) if name.split(".")[0] in siblings)
        for path in python_files("scripts")
    }
    assert len(offenders) >= 10  # the rule reads the scripts that exist
    assert {path: names for path, names in offenders.items() if names} == {}


@pytest.mark.parametrize("where", SCRIPT_USERS)
def test_nothing_imports_a_script(where: str) -> None:
    offenders = {str(path.relative_to(ROOT)) for path in python_files(where)
                 if any(name.split(".")[0] == "scripts" for name in imported_modules(path))}
    assert offenders == set()
