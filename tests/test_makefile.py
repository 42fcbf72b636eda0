"""`make`'s environment rule as `make -n` prints it: what a fresh clone and a reinstall would run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_pip_is_upgraded_only_as_the_environment_is_created(tmp_path: Path) -> None:
    """Issue 34: every reinstall (a changed stamp) upgraded pip over the network. The upgrade now rides on the
    creation of the environment, which a reinstall into an existing one skips."""
    venv = tmp_path / "venv"
    printed = subprocess.run(["make", "-n", f"VENV={venv}", "venv"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    commands = [line for line in printed if not line.startswith("#")]
    assert [line for line in commands if " --upgrade" in line] == [
        f"test -x {venv}/bin/python || python3 -m venv --upgrade-deps {venv}"]
    assert f"{venv}/bin/python -m pip install --quiet -e '.[test]'" in commands  # the project, every time
