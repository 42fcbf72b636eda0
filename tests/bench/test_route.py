"""`tenzro bench route` end to end: local small-model nodes behind a router per routing, every turn answered once,
agents' back-to-back follow-ups reported on their own."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from bench.local_node import TENZRO
from bench.route import add_route_bench

CALLERS, TURNS, NODES = 4, 3, 2


def test_bench_route_answers_every_turn_once_and_the_warm_bias_keeps_conversations_warm(tmp_path: Path) -> None:
    out = tmp_path / "route.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [*TENZRO, "bench", "route", "--nodes", str(NODES), "--callers", str(CALLERS), "--turns", str(TURNS),
         "--system-words", "60", "--think-s", "0.5", "--routings", "warm,round-robin", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {row["routing"]: row for row in report["rows"]}
    assert set(rows) == {"warm", "round-robin"}
    for routing, row in rows.items():
        turns = [turn for turn in report["turns"] if turn["routing"] == routing]
        assert sorted((turn["caller"], turn["turn"], turn["back_to_back"]) for turn in turns) == [
            (caller, turn, turn > 0 and caller % 2 == 0)  # none lost, none twice; every other caller an agent
            for caller in range(CALLERS) for turn in range(TURNS)]
        assert {turn["provider"] for turn in turns} <= {"node0", "node1"}
        assert sum(row["load"].values()) == CALLERS * TURNS and row["follow_ups"] == CALLERS * (TURNS - 1)
        assert row["back_to_back"] == CALLERS // 2 * (TURNS - 1)
    # The warm bias sends a follow-up to the node holding its conversation (round-robin's rate depends on how
    # the callers' turns interleave, so it is reported, not asserted).
    assert rows["warm"]["warm_rate"] >= 0.75 and rows["warm"]["warm_back_to_back"] >= 0.75


def test_the_help_names_no_fixed_number_of_nodes() -> None:
    """It said "three local nodes" whatever --nodes was (issue 34)."""
    groups = argparse.ArgumentParser(prog="tenzro bench").add_subparsers()
    add_route_bench(groups)
    text = " ".join(groups.choices["route"].format_help().split())
    assert "three" not in text
    assert "local nodes (--nodes) behind a router" in text
    assert "--nodes NODES local nodes behind the router (default: 3)" in text
