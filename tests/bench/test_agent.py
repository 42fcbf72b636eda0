"""`tenzro bench agent` end to end on a small hybrid (Bamba) model, and its workload and summary."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.agent import MAX_TOKENS, AgentWorkload, Sample, reply_mismatches, summarise
from bench.local_node import TENZRO
from tests.node.conftest import start_node, stop_node

EPISODES, STEPS = 1, 4
BUDGET_MODES = ["ours-value-1MiB", "ours-lru-1MiB"]
LOCAL_MODES = ["ours", "none", "exact", "interval-512", "oracle", *BUDGET_MODES]
TABLE_MODES = ["none", "exact", "interval-512", "ours", "oracle", *BUDGET_MODES]
FIRST_PROMPT_TOKENS = 1555  # system prompt, tools and task of episode 1, rendered by the embedded tokenizer


@dataclass(frozen=True)
class BenchRun:
    stdout: str
    report: dict[str, Any]


def _bench(out: Path, home: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*TENZRO, "bench", "agent", "--episodes", str(EPISODES), "--steps", str(STEPS),
                             "--out", str(out), *extra], env={**os.environ, "TENZRO_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BenchRun]:
    """Two runs at once (their timings do not matter here; their token counts are exact): every local mode
    with a budget, and, without one, a node measured through --url."""
    from node.engine.synthetic import init_model

    tmp = tmp_path_factory.mktemp("bench-agent")
    model = str(init_model("bamba", tmp / "bamba", size="small"))
    node = start_node(tmp / "node", Path(model))
    try:
        processes = {"local": _bench(tmp / "local.json", tmp / "home1", "--model", model, "--budget-mib", "1"),
                     "url": _bench(tmp / "url.json", tmp / "home2", "--url", node.url, "--api-key",
                                   node.add_key("bench"))}
        outputs = {name: process.communicate(timeout=300) for name, process in processes.items()}
    finally:
        stop_node(node)
    for name, process in processes.items():
        assert process.returncode == 0, outputs[name][1]
    return {name: BenchRun(outputs[name][0], json.loads((tmp / f"{name}.json").read_text())) for name in processes}


def _by_mode(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    modes: dict[str, list[dict[str, Any]]] = {}
    for sample in report["samples"]:
        modes.setdefault(sample["mode"], []).append(sample)
    return modes


def test_workload_is_seeded_and_edits_thirty_percent_of_resent_replies() -> None:
    workload = AgentWorkload(0, 3, 10)
    again = AgentWorkload(0, 3, 10)
    assert (workload.system, workload.tasks, workload.results, workload.edits) == (
        again.system, again.tasks, again.results, again.edits)
    assert len(workload.edits) == 8  # 30% of the 27 replies that a later step re-sends
    assert all(step < 9 for _, step in workload.edits)
    assert len(set(workload.tasks)) == 3
    episode, step = min(workload.edits)
    word = workload.edits[(episode, step)]
    assistant, tool = workload.after_reply(episode, step, "abcdef")
    assert assistant == {"role": "assistant", "content": f"abc {word} def"}
    assert tool == {"role": "tool", "content": workload.results[episode][step]}
    assert workload.edited(episode, step + 1) and not workload.edited(episode, step)
    unedited = next(s for s in range(9) if (0, s) not in workload.edits)
    assert workload.after_reply(0, unedited, "abcdef")[0]["content"] == "abcdef"
    assert [m["role"] for m in workload.opening(1)] == ["system", "user"]
    assert workload.opening(1)[0] == workload.opening(2)[0]


def _sample(mode: str, step: int, prompt: int, cached: int, ttft: float, target: int | None = None) -> Sample:
    return Sample(mode, 0, step, False, prompt, cached, ttft, MAX_TOKENS, f"reply {step}", target_tokens=target)


def test_summary_counts_reuse_against_the_oracle_and_takes_nearest_rank_p90() -> None:
    samples = [_sample("ours", 0, 100, 0, 10.0), _sample("ours", 1, 200, 90, 4.0),
               _sample("oracle", 0, 100, 0, 9.0, target=0), _sample("oracle", 1, 200, 120, 3.0, target=120),
               _sample("none", 0, 100, 0, 11.0), _sample("none", 1, 200, 0, 20.0)]
    rows = {row.mode: row for row in summarise(samples)}
    assert [row.mode for row in summarise(samples)] == ["none", "ours", "oracle"]
    assert (rows["ours"].reused_tokens, rows["ours"].prefilled_tokens, rows["ours"].reused_fraction) == (90, 210, 0.3)
    assert rows["ours"].of_oracle == 0.75 and rows["oracle"].of_oracle == 1.0 and rows["none"].of_oracle == 0.0
    assert (rows["none"].ttft_p50_ms, rows["none"].ttft_p90_ms) == (15.5, 20.0)
    assert rows["ours"].server_ttft_p50_ms is None


def test_reply_mismatches_name_the_mode_and_step() -> None:
    same = [_sample("ours", 0, 100, 0, 1.0), _sample("none", 0, 100, 0, 1.0)]
    assert reply_mismatches(same) == []
    differing = [*same, _sample("exact", 0, 100, 0, 1.0)]
    differing[-1] = Sample("exact", 0, 0, False, 100, 0, 1.0, MAX_TOKENS, "other")
    assert reply_mismatches(differing) == ["exact (episode 1, step 1: 'other' vs 'reply 0')"]


def test_bench_agent_local_modes_reuse_as_their_policies_allow(runs: dict[str, BenchRun]) -> None:
    stdout, report = runs["local"].stdout, runs["local"].report
    settings = report["settings"]
    assert settings == {"url": None, "model": "bamba", "threads": 1, "device": None, "episodes": EPISODES,
                        "steps": STEPS, "max_tokens": MAX_TOKENS, "edit_fraction": 0.3, "seed": 0, "budget_mib": 1,
                        "modes": LOCAL_MODES}
    assert report["replies_identical"] is True
    modes = _by_mode(report)
    assert list(modes) == LOCAL_MODES
    keys = [(s["episode"], s["step"], s["prompt_tokens"], s["reply"]) for s in modes["ours"]]
    assert keys[0][2] == FIRST_PROMPT_TOKENS
    for samples in modes.values():
        assert [(s["episode"], s["step"], s["prompt_tokens"], s["reply"]) for s in samples] == keys
        assert all(s["ttft_ms"] > 0 and s["server_ttft_ms"] > 0 for s in samples)
        assert samples[0]["cached_tokens"] == 0
    assert sum(s["edited"] for s in modes["ours"]) == 1
    assert all(s["cached_tokens"] == 0 and s["matched_tokens"] == 0 for s in modes["none"])
    ours, oracle = modes["ours"], modes["oracle"]
    for previous, sample in zip(ours, ours[1:], strict=False):
        # one token before the end of the previous prompt is a snapshot (the retry point), and the history agrees
        # with it up to there at least (past it where the reply was sent back unedited: its end is one too)
        assert previous["prompt_tokens"] - 1 <= sample["cached_tokens"] <= sample["matched_tokens"]
        assert sample["cached_tokens"] >= previous["prompt_tokens"] + MAX_TOKENS or sample["edited"]
    # the primed node resumes exactly where the ours node saw the prompt leave the stored tokens
    assert [s["target_tokens"] for s in oracle] == [s["matched_tokens"] for s in ours]
    assert [s["cached_tokens"] for s in oracle] == [s["matched_tokens"] for s in ours]

    rows = {row["mode"]: row for row in report["rows"]}
    assert [row["mode"] for row in report["rows"]] == TABLE_MODES
    assert rows["none"]["reused_tokens"] == 0 and rows["none"]["prefilled_tokens"] == rows["none"]["prompt_tokens"]
    assert rows["oracle"]["reused_tokens"] == sum(s["matched_tokens"] for s in ours)
    assert rows["ours"]["reused_tokens"] >= rows["exact"]["reused_tokens"]
    assert rows["ours"]["of_oracle"] >= 0.9
    memory = report["snapshot_memory"]
    assert memory["stored_tokens"] == sum(s["prompt_tokens"] - s["matched_tokens"] + MAX_TOKENS for s in ours)
    assert 0 < memory["snapshot_bytes"] < memory["cached_bytes"]
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["mode", "reused", "of"]
    assert [line.split()[0] for line in lines[1:8]] == TABLE_MODES
    assert lines[8].startswith("state held at the end of 'ours':")


def test_bench_agent_measures_a_url_as_its_only_mode(runs: dict[str, BenchRun]) -> None:
    stdout, report = runs["url"].stdout, runs["url"].report
    ours = _by_mode(runs["local"].report)["ours"]
    assert report["settings"]["url"].startswith("http://127.0.0.1:") and report["settings"]["model"] == "bamba"
    assert report["settings"]["threads"] is None and report["settings"]["budget_mib"] == 0
    assert report["settings"]["modes"] == ["url"]
    assert report["snapshot_memory"] is None
    samples = report["samples"]
    assert [(s["mode"], s["step"]) for s in samples] == [("url", step) for step in range(STEPS)]
    assert [s["reply"] for s in samples] == [s["reply"] for s in ours]  # the same node code and model
    assert samples[0]["prompt_tokens"] == FIRST_PROMPT_TOKENS and samples[0]["cached_tokens"] == 0
    for previous, sample in zip(samples, samples[1:], strict=False):
        assert sample["cached_tokens"] >= previous["prompt_tokens"] - 1  # as in the local run
        # A tenzro node at --url reports its own timing and matched tokens in usage, as a local node does.
        assert sample["server_ttft_ms"] > 0 and sample["matched_tokens"] >= sample["cached_tokens"]
    assert [row["mode"] for row in report["rows"]] == ["url"] and report["rows"][0]["of_oracle"] is None
    assert stdout.splitlines()[1].split()[0] == "url"
