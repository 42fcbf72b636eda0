"""scripts/device_check.sh: valid shell, the exact commands of the GPU check, and a failed or overlong step recorded
while the others still run, within the run's time budget."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {name: value for name, value in os.environ.items() if not name.startswith("DEVICE_CHECK_")}
    return subprocess.run(["bash", str(SCRIPT)], env={**base, "OUT": str(tmp_path / "out"),
                                                      "DEVICE_CHECK_WORK": str(tmp_path / "work"),
                                                      "DEVICE_CHECK_WHEELS": str(tmp_path / "wheels"), **env},
                          capture_output=True, text=True, timeout=60)


def test_the_script_is_valid_shell() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("wheels", [[], ["openai-2.8.1-py3-none-any.whl", "cryptography-50.0.2-cp311-abi3.whl"]])
def test_a_dry_run_prints_the_commands_of_the_check(tmp_path: Path, wheels: list[str]) -> None:
    (tmp_path / "wheels").mkdir()
    for name in wheels:
        (tmp_path / "wheels" / name).write_bytes(b"")
    done = run(tmp_path, DEVICE_CHECK_DRY_RUN="1", PYTHON="python3")
    model, out, where = f"{tmp_path}/work/dense-1b", f"{tmp_path}/out", f"{tmp_path}/wheels"
    install = [f"python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               f"--find-links {where} --target {tmp_path}/work/site {where}/{wheels[1]} {where}/{wheels[0]}"
               ] if wheels else []  # in name order
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv",
        *install,
        "python3 -c import torch, transformers; print('torch', torch.__version__, 'transformers', "
        "transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())",
        "python3 -m pytest -q -p no:cacheprovider -n 8 tests/node/test_reuse_matrix.py",
        "python3 -m pytest -q -p no:cacheprovider -n 4 tests/node/engine/test_batching.py "
        "tests/node/engine/test_static_decode.py",
        f"python3 -m node models init --arch dense --size 1b {model}",
        f"python3 -m node bench reuse --device cuda --lengths 1024,4096,16384 --runs 3 --model {model} "
        f"--out {out}/reuse-1b.json",
        f"python3 -m node bench load --device cuda --clients 1,8,32,64 --duration 12 --model {model} "
        f"--json {out}/load-1b.json",
        f"python3 -m node bench seal --device cuda --lengths 1024,4096,16384 --runs 3 --model {model} "
        f"--out {out}/seal-1b.json",
        f"python3 scripts/dtype_agreement.py --device cuda --dtype bfloat16 --out {out}/bf16-agreement.json",
        f"env TENZRO_CUDA_GRAPHS=off python3 -m node bench load --device cuda --clients 32 --duration 12 "
        f"--model {model} --json {out}/load-1b-eager.json",
        f"python3 -m node audit timing --device cuda --model {model} --samples 30 --length 4096 --seed 38 "
        f"--out {out}/audit-timing.json",
        f"python3 -m node models init --arch hybrid --size 1b {tmp_path}/work/hybrid-1b",
        f"python3 -m node bench load --device cuda --clients 32 --duration 12 --model {tmp_path}/work/hybrid-1b "
        f"--json {out}/load-1b-hybrid.json",
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_a_failed_or_overlong_step_is_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    """Stand-ins for python3 and nvidia-smi: the batching tests fail, `bench load` outlasts the 3 s budget, so
    it is stopped there and `bench seal` finds no time left."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\necho H200\n")
    (tools / "python3").write_text('#!/bin/bash\necho "ran $*"\n[[ "$*" == *test_batching* ]] && exit 3\n'
                                   '[[ "$*" == *"bench load"* ]] && sleep 20\nexit 0\n')
    for tool in tools.iterdir():
        tool.chmod(0o755)
    done = run(tmp_path, PATH=f"{tools}:{os.environ['PATH']}", DEVICE_CHECK_SECONDS="3", PYTHON="python3")
    assert done.returncode == 3
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert [(step["step"], step["exit"]) for step in report["steps"]] == [
        ("machine", 0), ("versions", 0), ("reuse-matrix", 0), ("batching", 3), ("model", 0), ("bench-reuse", 0),
        ("bench-load", 124), ("bench-seal", 124), ("bf16-agreement", 124),
        ("bench-load-eager", 124), ("audit-timing", 124), ("model-hybrid", 124), ("bench-load-hybrid", 124)]
    assert (report["device"], report["size"], report["budget_s"]) == ("cuda", "1b", 3) and report["seconds"] <= 4
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert "ran -m pytest -q -p no:cacheprovider -n 4 tests/node/engine/test_batching.py" in log
    assert "=== bench-load: exit 124" in log and "ran -m node bench seal" not in log
