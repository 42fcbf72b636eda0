"""scripts/dtype_agreement.py: in float32 every request of the matrix's conversations replies alike with reuse on
and off, reused tokens and all; the JSON says so per family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_float32_agrees_token_for_token_on_every_request(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "dtype_agreement.py"), "--device", "cpu",
                           "--dtype", "float32", "--families", "llama", "--new-tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                                                         "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    (llama,) = report["families"]
    assert (report["dtype"], llama["family"], llama["requests"], llama["agree"]) == ("float32", "llama", 5, 5)
    assert llama["first_differences"] == [None] * 5
    cached = llama["cached_tokens"]
    assert cached[0] == 0 and all(tokens > 0 for tokens in cached[1:])  # reuse ran: the figures are about it
