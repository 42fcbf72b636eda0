"""The node as a user installs it: a wheel built from this tree, installed into a fresh environment, serves.

The wheel carries the native kernels built at install (on an x86-64 machine with a C++ compiler) and the
shipped policies; nothing is read from the source tree. A build without a working compiler still gives a
wheel, without the kernels. The fresh environment takes the node from the wheel alone; its dependencies
(torch, transformers, ...) are this environment's, reached through a path file rather than installed a
second time, which would take minutes and gigabytes for nothing this test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

import openai

from node.engine.cpu_kernels import library_path, load_kernels
from tests.node.conftest import free_port, http_status

ROOT = Path(__file__).resolve().parents[1]
SKIP_IN_COPY = shutil.ignore_patterns(".git", ".venv", "build", "dist", "__pycache__", "*.so", "*.egg-info",
                                      ".pytest_cache", ".mypy_cache", ".ruff_cache", "bench-results")


def build_wheel(source: Path, out: Path, env: dict[str, str] | None = None) -> Path:
    """A wheel of `source` (a copy of this tree) in `out`, built with this environment's setuptools."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(out), str(source)], capture_output=True, text=True, timeout=600,
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = out.glob("tenzro-*.whl")
    return wheel


def fresh_environment(where: Path) -> Path:
    """A new virtual environment whose own site-packages holds nothing of the node; returns its python."""
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # Dependencies only: a path line in a .pth file runs none of that directory's own .pth files, so the
    # editable install of this tree stays out of reach.
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_a_wheel_installed_into_a_fresh_environment_serves_a_chat(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=SKIP_IN_COPY)
    wheel = build_wheel(source, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "policies/pricing.yaml" in names and "node/engine/kernels/cpu_kernels.cpp" in names
    built_here = library_path() is not None  # this environment's install could build the kernels
    assert any(name.startswith("node/engine/_cpu_kernels") and name.endswith(".so") for name in names) == built_here

    python = fresh_environment(tmp_path / "venv")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    where = subprocess.run([str(python), "-c", "import node, policies; print(node.__file__, policies.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert all(Path(path).is_relative_to(tmp_path / "venv") for path in where)

    home, port = tmp_path / "home", free_port()
    env = {**os.environ, "TENZRO_HOME": str(home)}
    with (tmp_path / "node.log").open("w") as log:
        process = subprocess.Popen([str(tmp_path / "venv" / "bin" / "tenzro"), "node", "serve", "--model", "default",
                                    "--port", str(port), "--threads", "1"], cwd=tmp_path, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while http_status(url + "/health") != 200:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
            time.sleep(0.2)
        text = (tmp_path / "node.log").read_text()
        key = next(line.split("=", 1)[1] for line in text.splitlines() if "export TENZRO_API_KEY=" in line)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
        assert (home / "pricing.yaml").is_file()  # the first price file, from the wheel's policies/
        with urllib.request.urlopen(url + "/v1/node", timeout=5) as response:  # loopback only
            code = json.load(response)["code"]
        # The code digest covers the files the wheel's RECORD lists, the kernels among them; nothing else is there.
        assert (code["source"], code["unlisted"], code["native_library"] is not None) == ("record", [], built_here)
        # The wheel's kernels serve wherever this environment's would (same build, same CPU checks).
        assert ("Forward: native" if load_kernels().kernels is not None else "Forward: transformers") in text
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_build_without_a_compiler_still_gives_a_wheel_without_the_kernels(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=SKIP_IN_COPY)
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"}
    names = zipfile.ZipFile(build_wheel(source, tmp_path / "dist", env)).namelist()
    assert "node/engine/kernels/cpu_kernels.cpp" in names
    assert not any(name.endswith(".so") for name in names)


def test_the_benchmarks_output_folder_is_never_a_package(tmp_path: Path) -> None:
    """`bench-results/` (what the benchmarks write in the checkout) once matched `bench*`: an editable install then
    mapped it as a package and the node refused to start (its code identity found a package in two places)."""
    import tomllib

    from setuptools import find_namespace_packages  # pyproject's `packages.find` finds namespace packages too

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for name in ("bench", "bench-results", "node", "node_extra"):
        (tmp_path / name).mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "node" / "__init__.py").write_text("")
    (tmp_path / "bench-results" / "reuse.json").write_text("{}")
    assert sorted(find_namespace_packages(str(tmp_path), include=include)) == ["bench", "node"]
    assert "bench-results" in find_namespace_packages(str(tmp_path), include=["bench*"])  # the old pattern's catch
