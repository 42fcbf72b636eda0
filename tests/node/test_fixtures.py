"""The node fixtures run on a machine that has the project on its import path but not its `tenzro` script (a GPU
machine without network, the project on PYTHONPATH), and on the device TENZRO_TEST_DEVICE names."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_python(python: Path | str, code: str, cwd: Path, device: str | None = None) -> str:
    """`code` run by `python` with this interpreter's packages and the project on PYTHONPATH, and
    TENZRO_TEST_DEVICE=`device` (unset for None); its output."""
    env = {name: value for name, value in os.environ.items() if name != "TENZRO_TEST_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join([*site.getsitepackages(), str(ROOT)])
    if device is not None:
        env["TENZRO_TEST_DEVICE"] = device
    done = subprocess.run([str(python), "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_fixtures_start_tenzro_without_its_installed_script(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"  # an interpreter whose bin/ holds no `tenzro`
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    code = ("import os; from tests.node.conftest import tenzro; done = tenzro('keys', 'remove', '--help', "
            "env=dict(os.environ)); print(done.returncode, done.stdout.splitlines()[0])")
    assert run_python(python, code, tmp_path) == "0 usage: tenzro keys remove [-h] [--config CONFIG] name\n"


@pytest.mark.parametrize(("device", "flags"), [
    (None, "('--device', 'cpu', '--dtype', 'float32')"),
    ("cuda", "('--device', 'cuda', '--dtype', 'float32')"),
])
def test_tenzro_test_device_names_the_device_and_keeps_float32(tmp_path: Path, device: str | None,
                                                               flags: str) -> None:
    code = "from tests.node.conftest import DEVICE_FLAGS; print(DEVICE_FLAGS)"
    assert run_python(sys.executable, code, tmp_path, device) == flags + "\n"
