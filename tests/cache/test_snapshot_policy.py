"""Where snapshots are taken, per policy."""

from __future__ import annotations

import pytest

from cache.snapshot_policy import PolicyError, SnapshotPolicy


def test_ours_keeps_the_retry_point_before_boundaries_and_boundaries_before_the_grid() -> None:
    policy = SnapshotPolicy.named("ours", interval=0)
    # 900 is 5 tokens before the end (the generation prompt's start): the retry point (904) covers it; 300 is
    # within the gap of 310, the later boundary.
    assert policy.prompt_positions(100, 905, boundaries=(50, 300, 310, 900), branch=400) == [310, 400, 904]
    # The retry point is kept even when a boundary lies right before it (issue 34: a re-sent prompt whose last
    # message is long lost that message when the end and its near boundary crowded each other out).
    assert policy.prompt_positions(0, 1862, boundaries=(20, 1858), branch=0) == [20, 1861]


def test_an_identical_prompt_can_resume_one_token_before_its_end() -> None:
    for name in ("ours",):
        positions = SnapshotPolicy.named(name).prompt_positions(0, 2000, boundaries=(), branch=0)
        assert positions[-1] == 1999


def test_the_grid_widens_with_the_position_and_yields_to_structure() -> None:
    ours = SnapshotPolicy.named("ours", interval=128)
    assert ours.grid(3000) == [128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1920, 2304, 2816]
    # Structured prompts get the grid too (inside long messages); a grid point near a boundary gives way.
    assert ours.prompt_positions(0, 700, boundaries=(250, 600), branch=0) == [128, 250, 384, 512, 600, 640, 699]
    # An edit at p recomputes fewer than max(interval, p / 4) tokens before it.
    grid = ours.grid(1 << 16)
    for p in range(1, 1 << 16, 97):
        resume = max((g for g in grid if g <= p), default=0)
        assert p - resume < max(128, p / 4)
    # A fixed interval, and no grid at all.
    fixed = SnapshotPolicy.named("interval", interval=128)
    assert fixed.prompt_positions(0, 400, boundaries=(200,), branch=150) == [128, 256, 384]
    assert SnapshotPolicy.named("ours", interval=0).grid(5000) == []


def test_exact_keeps_only_the_end_of_prompt_and_reply_together() -> None:
    exact = SnapshotPolicy.named("exact")
    assert exact.prompt_positions(0, 400, boundaries=(200,), branch=150) == []
    assert exact.reply_end and not exact.prompt_end and not exact.anywhere


def test_unknown_policy_and_negative_interval_are_refused() -> None:
    with pytest.raises(PolicyError, match="choose ours, interval or exact"):
        SnapshotPolicy.named("sometimes")
    with pytest.raises(PolicyError, match="interval"):
        SnapshotPolicy.named("ours", interval=-1)
