"""`tenzro audit timing`: the two-sample KS test against hand-derived values, the verdict on crafted samples,
and one end-to-end run against a local small-model node, which must see A's own reuse and give B none."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from bench.local_node import TENZRO
from node.audit_timing import ALPHA, MIN_SAMPLES, Sample, judge, kolmogorov_q, ks_two_sample, prompt_text
from node.cli import build_parser

SAMPLES = 12
LENGTH = 1024
"""Prompt tokens: enough that the small model's miss takes several times a hit. At 256 the native prefill made a
miss so cheap that 12 samples on a loaded machine could not always tell the two apart."""


def test_ks_fully_separated_small_samples() -> None:
    d, p = ks_two_sample([1, 2, 3], [4, 5, 6])
    assert d == 1.0
    # ne = 3*3/6 = 1.5; lambda = sqrt(1.5) + 0.12 + 0.11/sqrt(1.5); terms past j = 3 are below 1e-30.
    lam = 1.224744871391589 + 0.12 + 0.08981462390204987
    assert p == pytest.approx(2 * (math.exp(-2 * lam**2) - math.exp(-8 * lam**2) + math.exp(-18 * lam**2)),
                              rel=1e-12)
    assert p == pytest.approx(0.03262, abs=1e-5)


def test_ks_identical_samples() -> None:
    assert ks_two_sample([1, 2, 3], [1, 2, 3]) == (0.0, 1.0)
    assert ks_two_sample([5.0, 5.0, 7.5], [7.5, 5.0, 5.0]) == (0.0, 1.0)


def test_ks_reference_separated_five_a_side() -> None:
    """D = 1; ne = 25/10 = 2.5; lambda = sqrt(2.5) + 0.12 + 0.11/sqrt(2.5) = 1.5811388 + 0.12 + 0.0695701
    = 1.7707089; lambda^2 = 3.1354101, so Q = 2 (e^-6.2708203 - e^-25.083281 + ...) = 2 (0.00189068 - 1.3e-11)
    = 0.00378135."""
    d, p = ks_two_sample([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert d == 1.0
    assert p == pytest.approx(0.00378135, abs=1e-8)


def test_ks_reference_with_ties() -> None:
    """ECDFs after each distinct value (x: 1..6, y: 4..9): at 3, 3/6 - 0 = 1/2; at 4, 4/6 - 1/6; at 5, 5/6 - 2/6;
    at 6, 6/6 - 3/6; then the gap closes, so D = 1/2. ne = 36/12 = 3; lambda = (sqrt(3) + 0.12 + 0.11/sqrt(3))/2
    = 0.9577797, lambda^2 = 0.9173419: Q = 2 (e^-1.834684 - e^-7.338735 + e^-16.512154) = 2 (0.1596640 -
    0.0006499 + 0.0000001) = 0.3180284. This lambda is below 1, where kolmogorov_q uses the theta form: the
    alternating series here checks that form."""
    d, p = ks_two_sample([1, 2, 3, 4, 5, 6], [4, 5, 6, 7, 8, 9])
    assert d == 0.5
    assert p == pytest.approx(0.3180284, abs=1e-7)


def test_ks_unequal_sizes_is_symmetric() -> None:
    """x = 0.5, 1.5, 2.5 against y = 1..10: after 2.5 F_x = 1 and F_y = 2/10, so D = 8/10."""
    x, y = [0.5, 1.5, 2.5], [float(v) for v in range(1, 11)]
    assert ks_two_sample(x, y) == ks_two_sample(y, x)
    assert ks_two_sample(x, y)[0] == 0.8


def test_ks_needs_min_samples_to_reject() -> None:
    assert ks_two_sample(range(MIN_SAMPLES - 1), range(100, 100 + MIN_SAMPLES - 1))[1] > ALPHA
    assert ks_two_sample(range(MIN_SAMPLES), range(100, 100 + MIN_SAMPLES))[1] < ALPHA


def test_ks_refuses_an_empty_sample() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ks_two_sample([], [1.0])


@pytest.mark.parametrize(("lam", "q"), [(1.2238, 0.10), (1.3581, 0.05), (1.4802, 0.025), (1.6276, 0.01),
                                        (1.9495, 0.001)])
def test_kolmogorov_q_matches_classical_critical_values(lam: float, q: float) -> None:
    assert kolmogorov_q(lam) == pytest.approx(q, rel=5e-4)


def test_kolmogorov_q_is_continuous_where_its_two_forms_meet() -> None:
    assert kolmogorov_q(1.0) == pytest.approx(0.2699996717, abs=1e-10)  # P(K <= 1) = 0.7300003283
    assert kolmogorov_q(1.0 - 1e-12) == pytest.approx(kolmogorov_q(1.0), abs=1e-10)
    assert kolmogorov_q(0.0) == 1.0


def _samples(ms: dict[str, list[float]], b_cached: int = 0) -> list[Sample]:
    callers = {"cached": "B", "not-cached": "B", "hit": "A", "miss": "A"}
    return [Sample(trial, order, condition, callers[condition], value, LENGTH,
                   b_cached if callers[condition] == "B" else 0)
            for order, (condition, values) in enumerate(ms.items()) for trial, value in enumerate(values)]


SAME = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
SHIFTED = [v + 0.5 for v in SAME]
FAST = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def test_judge_passes_isolated_callers_with_visible_own_reuse() -> None:
    verdict = judge(_samples({"cached": SAME, "not-cached": SHIFTED, "hit": FAST, "miss": SAME}))
    assert verdict.failures == ()
    assert [(r.test, r.rejects, r.passed) for r in verdict.rows] == [("cross-caller", False, True),
                                                                     ("own-caller", True, True)]
    assert (verdict.rows[0].with_state_median_ms, verdict.rows[0].without_state_median_ms) == (12.5, 13.0)
    assert (verdict.b_requests, verdict.b_cached_requests) == (12, 0)


def test_judge_fails_a_cross_caller_difference() -> None:
    verdict = judge(_samples({"cached": FAST, "not-cached": SAME, "hit": FAST, "miss": SAME}))
    assert len(verdict.failures) == 1
    assert verdict.failures[0].startswith("cross-caller: B's time to first token depends")


def test_judge_fails_when_own_reuse_is_invisible() -> None:
    verdict = judge(_samples({"cached": SAME, "not-cached": SAME, "hit": SAME, "miss": SHIFTED}))
    assert len(verdict.failures) == 1
    assert verdict.failures[0].startswith("own-caller: the audit cannot tell A's own cache hits from misses")


def test_judge_fails_cached_tokens_for_b() -> None:
    verdict = judge(_samples({"cached": SAME, "not-cached": SHIFTED, "hit": FAST, "miss": SAME}, b_cached=7))
    assert verdict.b_cached_requests == 12
    assert verdict.failures == ("caller B was reported cached tokens (or none reported) in 12 of 12 requests: "
                                "B must reuse nothing of A's prompt state",)


@pytest.mark.parametrize(("argv", "message"), [
    (["--samples", str(MIN_SAMPLES - 1)], "--samples must be at least 5"),
    (["--length", "1"], "--length must be at least 2"),
    (["--url", "http://127.0.0.1:9", "--key-a", "k"], "--url needs --key-a and --key-b"),
    (["--key-a", "k"], "--key-a and --key-b are for --url"),
])
def test_refuses_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["audit", "timing", *argv])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_audit_detects_own_reuse_and_gives_b_none(small_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results" / "audit.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [*TENZRO, "audit", "timing", "--model", str(small_model_dir), "--samples", str(SAMPLES), "--length",
         str(LENGTH), "--seed", "7", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr

    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["local"] is True and settings["model"] == small_model_dir.name
    assert (settings["samples"], settings["length"], settings["seed"], settings["threads"]) == (SAMPLES, LENGTH,
                                                                                                 7, 1)
    samples = report["samples"]
    assert sorted((s["trial"], s["order"]) for s in samples) == [(t, o) for t in range(SAMPLES) for o in range(4)]
    for trial in range(SAMPLES):
        assert sorted(s["condition"] for s in samples if s["trial"] == trial) == ["cached", "hit", "miss",
                                                                                   "not-cached"]
    expected_cached = {"cached": 0, "not-cached": 0, "hit": LENGTH - 1, "miss": 0}
    for sample in samples:
        assert sample["prompt_tokens"] == LENGTH
        assert sample["cached_tokens"] == expected_cached[sample["condition"]], sample
        assert sample["ttft_ms"] > 0
    assert (report["b_requests"], report["b_cached_requests"]) == (2 * SAMPLES, 0)

    cross, own = report["rows"]
    assert own["test"] == "own-caller" and own["rejects"] and own["p"] < ALPHA, own
    assert own["with_state_median_ms"] < own["without_state_median_ms"]
    # The cross-caller test may reject by chance (1 run in 100 under isolation): then, and only then, exit 1.
    assert cross["test"] == "cross-caller"
    assert report["passed"] == (not cross["rejects"]) == (result.returncode == 0)
    if cross["rejects"]:
        assert len(report["failures"]) == 1 and report["failures"][0].startswith("cross-caller:")
    else:
        assert report["failures"] == []

    lines = result.stdout.splitlines()
    assert lines[0].split() == ["test", "compared", "samples", "median", "ms", "median", "ms", "D", "p", "verdict"]
    assert [line.split()[0] for line in lines[1:3]] == ["cross-caller", "own-caller"]
    assert lines[2].endswith("differ: pass")
    assert lines[3] == f"caller B: cached tokens not 0 in 0 of {2 * SAMPLES} requests: pass"


def test_the_group_audit_has_a_member_write_its_groups_scope_and_a_non_member_read_nothing(
        small_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    env = {**os.environ, "TENZRO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [*TENZRO, "audit", "timing", "--model", str(small_model_dir), "--samples", str(MIN_SAMPLES), "--length", "32",
         "--seed", "7", "--group", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["group"] is True
    assert (report["b_requests"], report["b_cached_requests"]) == (2 * MIN_SAMPLES, 0)
    for sample in report["samples"]:
        if sample["condition"] == "hit":  # A's own second request: all but the last token
            assert sample["cached_tokens"] == sample["prompt_tokens"] - 1, sample
        elif sample["condition"] == "miss":  # a fresh prompt: only the chat template's opening tokens
            assert 0 < sample["cached_tokens"] < 8, sample
    assert "A a member of a trust group, B not" in result.stderr


def test_prompt_text_writes_each_id_as_a_word_of_its_own() -> None:
    assert prompt_text([0, 25, 26, 27, 26 * 26]) == "a z ab bb aab"
