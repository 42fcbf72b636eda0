"""`tenzro bench reuse` end to end against a local small-model node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TENZRO = str(Path(sys.executable).parent / "tenzro")
LENGTHS = (64, 128)
NEW_TOKENS = 8
RUNS = 2


def test_bench_reuse_reports_exact_prefix_reuse(small_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results" / "x.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [TENZRO, "bench", "reuse", "--model", str(small_model_dir), "--lengths", ",".join(map(str, LENGTHS)),
         "--runs", str(RUNS), "--new-tokens", str(NEW_TOKENS), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["local"] is True
    assert settings["model"] == small_model_dir.name
    assert settings["url"].startswith("http://127.0.0.1:") and settings["url"].endswith("/v1")
    assert (settings["threads"], settings["runs"], settings["new_tokens"]) == (1, RUNS, NEW_TOKENS)
    assert settings["lengths"] == list(LENGTHS)

    samples = report["samples"]
    assert [(s["length"], s["run"], s["kind"]) for s in samples] == [
        (length, run, kind) for length in LENGTHS for run in range(RUNS)
        for kind in ("cold", "after-other", "reused")]
    for sample in samples:
        assert sample["ttft_ms"] > 0
        assert sample["prompt_tokens"] == sample["length"]
        expected_cached = 0 if sample["kind"] == "cold" else sample["length"] - NEW_TOKENS
        assert sample["cached_tokens"] == expected_cached

    rows = report["rows"]
    assert [r["prompt_tokens"] for r in rows] == list(LENGTHS)
    for row in rows:
        assert row["cold_ttft_ms"] > 0 and row["reused_ttft_ms"] > 0 and row["after_other_ttft_ms"] > 0
        assert row["ratio"] == row["reused_ttft_ms"] / row["cold_ttft_ms"]
        assert row["ideal_ratio"] == NEW_TOKENS / row["prompt_tokens"]
        assert row["reused_cached_tokens"] == [row["prompt_tokens"] - NEW_TOKENS] * RUNS

    lines = result.stdout.splitlines()
    assert lines[0].split() == ["prompt", "tokens", "cold", "TTFT", "ms", "reused", "TTFT", "ms",
                                "reused/cold", "ideal", "after", "other", "ms", "cached", "(reused)"]
    assert [line.split()[0] for line in lines[1:]] == [str(length) for length in LENGTHS]
    assert [line.split()[-1] for line in lines[1:]] == [str(length - NEW_TOKENS) for length in LENGTHS]
