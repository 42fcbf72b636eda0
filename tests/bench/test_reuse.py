"""`tenzro bench reuse` end to end against a local small-model node."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.local_node import TENZRO

LENGTHS = (64, 128)
NEW_TOKENS = 8
RUNS = 2


def test_bench_reuse_reports_exact_prefix_reuse(small_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results" / "x.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [*TENZRO, "bench", "reuse", "--model", str(small_model_dir), "--lengths", ",".join(map(str, LENGTHS)),
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


def test_bench_reuse_tls_both_measures_a_plain_and_a_pinned_tls_node_on_the_same_prompts(small_model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    out = tmp_path / "tls.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [*TENZRO, "bench", "reuse", "--model", str(small_model_dir), "--lengths", "64", "--runs", "2",
         "--new-tokens", str(NEW_TOKENS), "--tls", "both", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    report = json.loads(out.read_text())
    assert report["settings"]["tls"] == "both" and report["settings"]["url"].startswith("http://127.0.0.1:")
    assert [(s["run"], s["transport"], s["kind"]) for s in report["samples"]] == [
        (0, "http", "cold"), (0, "http", "after-other"), (0, "http", "reused"),
        (0, "https", "cold"), (0, "https", "after-other"), (0, "https", "reused"),
        (1, "https", "cold"), (1, "https", "after-other"), (1, "https", "reused"),
        (1, "http", "cold"), (1, "http", "after-other"), (1, "http", "reused")]
    assert {(s["kind"], s["cached_tokens"]) for s in report["samples"]} == {
        ("cold", 0), ("after-other", 64 - NEW_TOKENS), ("reused", 64 - NEW_TOKENS)}
    assert [(row["transport"], row["prompt_tokens"]) for row in report["rows"]] == [("http", 64), ("https", 64)]
    assert "over https" in result.stderr and "https://127.0.0.1:" in result.stderr

    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["transport", "prompt", "tokens"]
    assert [line.split()[:2] for line in lines[1:3]] == [["http", "64"], ["https", "64"]]
    ratio = report["rows"][1]["reused_ttft_ms"] / report["rows"][0]["reused_ttft_ms"]
    assert lines[3] == f"reused TTFT, https over http: 64 tokens {ratio:.3f}"


def test_tls_runs_local_nodes_only() -> None:
    result = subprocess.run([*TENZRO, "bench", "reuse", "--url", "http://127.0.0.1:1", "--tls", "on"],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (
        2, "tenzro: error: --tls runs local nodes; measure an https server by giving its --url\n")
