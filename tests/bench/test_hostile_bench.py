"""`tenzro bench hostile`: a short run against its own local node prints a line per case and writes its report,
with the answers the node already gives fixed; a URL that is not loopback is refused before anything is sent."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.client import BenchError
from bench.hostile import Row, format_table, loopback_address, summarise
from bench.hostile_load import Tally
from bench.local_node import TENZRO
from node.cli import build_parser

CASES = ["empty-messages", "slowloris", "two-auth"]
CONNECTIONS = 3
HEADER = ["case", "clients", "/health", "p50", "ms", "max", "ms", "chat", "p50", "ms", "max", "ms", "chats", "failed",
          "answer", "p50", "ms", "max", "ms", "hostile", "requests", "got"]


@pytest.fixture(scope="module")
def run(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bench-hostile")
    done = subprocess.run([*TENZRO, "bench", "hostile", "--model", str(small_model_dir), "--seconds", "1",
                           "--cases", ",".join(CASES), "--clients", "2", "--connections", str(CONNECTIONS),
                           "--json", str(tmp / "hostile.json")],
                          env={**os.environ, "TENZRO_HOME": str(tmp / "home")}, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((tmp / "hostile.json").read_text())


def test_a_short_run_prints_a_line_per_case_after_the_baseline(run: tuple[str, dict[str, Any]]) -> None:
    stdout, report = run
    lines = stdout.splitlines()
    assert lines[0].split() == HEADER
    assert [line.split()[0] for line in lines[1:]] == ["baseline", *CASES]
    assert [line.split()[1] for line in lines[1:]] == ["0", "2", str(CONNECTIONS), "2"]
    for line, row in zip(lines[1:], report["rows"], strict=True):
        assert line.endswith("  " + (", ".join(f"{outcome} x {count}" for outcome, count in row["outcomes"].items())
                                     or "-"))


def test_the_report_holds_settings_rows_and_every_sample(run: tuple[str, dict[str, Any]],
                                                         small_model_dir: Path) -> None:
    _, report = run
    assert list(report) == ["settings", "rows", "samples"]
    settings = report["settings"]
    assert settings["url"].startswith("http://127.0.0.1:") and settings["model"] == small_model_dir.name
    assert (settings["local"], settings["seconds"], settings["cases"], settings["hostile_callers"]) == (
        True, 1.0, ["baseline", *CASES], 2)
    assert (settings["probe_interval_s"], settings["chat_max_tokens"]) == (0.05, 4)
    assert [row["case"] for row in report["rows"]] == ["baseline", *CASES]
    for row in report["rows"]:
        samples = [s for s in report["samples"] if s["case"] == row["case"]]
        health = sorted(s["latency_ms"] for s in samples if s["kind"] == "health")
        chats = sorted(s["latency_ms"] for s in samples if s["kind"] == "chat")
        assert (row["health_probes"], row["chats"]) == (len(health), len(chats))
        assert len(health) > 0 and len(chats) > 0
        assert (row["health_max_ms"], row["chat_max_ms"]) == (health[-1], chats[-1])
        assert row["failed"] == sum(s["error"] is not None for s in samples) == 0
        assert all(0 <= s["start_s"] < 1.0 for s in samples)
        assert row["hostile_requests"] == sum(row["outcomes"].values())
    baseline = report["rows"][0]
    assert (baseline["hostile_clients"], baseline["hostile_requests"], baseline["outcomes"]) == (0, 0, {})


def test_the_node_refuses_the_empty_messages_and_holds_or_answers_every_stalled_connection(
        run: tuple[str, dict[str, Any]]) -> None:
    rows = {row["case"]: row for row in run[1]["rows"]}
    # Both callers' last requests may be in flight when the second ends; every other got its 400.
    empty = rows["empty-messages"]["outcomes"]
    assert empty["400"] > 0 and set(empty) <= {"400", "open"} and empty.get("open", 0) <= 2
    assert rows["empty-messages"]["hostile_answer_max_ms"] is not None
    assert sum(rows["slowloris"]["outcomes"].values()) >= CONNECTIONS
    assert all(outcome.isdigit() or outcome == "open" for outcome in rows["two-auth"]["outcomes"])


def _row(case: str, outcomes: dict[str, int]) -> Row:
    tally = Tally(Counter(outcomes), [12.5, 3.25] if outcomes else [])
    return summarise(case, 4 if outcomes else 0, [], tally)


def test_the_table_puts_the_outcomes_last_most_frequent_first() -> None:
    table = format_table([_row("baseline", {}), _row("gzip-bomb", {"open": 4, "415": 812})])
    assert table.splitlines() == [
        "case       clients  /health p50 ms  max ms  chat p50 ms  max ms  chats  failed  answer p50 ms  max ms"
        "  hostile requests got",
        "baseline         0               -       -            -       -      0       0              -       -  -",
        "gzip-bomb        4               -       -            -       -      0       0            3.2    12.5"
        "  415 x 812, open x 4"]


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.1:8000", "https://127.0.0.1:8000",
                                 "http://127.0.0.1.example.com"])
def test_only_plain_http_to_a_loopback_address_is_measured(url: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BenchError, match="only to http:// at a loopback address"):
        loopback_address(url)
    args = build_parser().parse_args(["bench", "hostile", "--url", url, "--api-key", "k", "--json",
                                      str(tmp_path / "hostile.json")])
    assert args.func(args) == 2
    assert "only to http:// at a loopback address" in capsys.readouterr().err
    assert not (tmp_path / "hostile.json").exists()


def test_loopback_addresses_and_localhost_are_measured() -> None:
    assert loopback_address("http://localhost:8000/v1") == ("127.0.0.1", 8000)
    assert loopback_address("http://127.0.0.2:9") == ("127.0.0.2", 9)
    assert loopback_address("http://[::1]:8000") == ("::1", 8000)


@pytest.mark.parametrize(("argv", "message"), [
    (["--cases", "gzip-bomb,nope"], "--cases must name cases among gzip-bomb, false-gzip, empty-messages, rpc, "
                                    "slowloris, slow-body, big-ints, two-auth, not 'gzip-bomb,nope'"),
    (["--seconds", "0"], "--seconds must be above 0, --clients, --connections and --threads at least 1"),
    (["--connections", "0"], "--seconds must be above 0, --clients, --connections and --threads at least 1"),
    (["--url", "http://127.0.0.1:9"], "--url needs --api-key (the normal caller's key)"),
])
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TENZRO_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = build_parser().parse_args(["bench", "hostile", *argv])
    assert args.func(args) == 2
    assert capsys.readouterr().err == f"tenzro: error: {message}\n"
