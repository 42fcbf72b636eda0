"""Where snapshots are taken, per policy."""

from __future__ import annotations

import pytest

from cache.snapshot_policy import PolicyError, SnapshotPolicy


def test_ours_takes_boundaries_branch_point_and_prompt_end_dropping_near_neighbours() -> None:
    policy = SnapshotPolicy.named("ours")
    # 900 is 5 tokens before the end (the generation prompt's start): the end covers it.
    assert policy.prompt_positions(100, 905, boundaries=(50, 300, 310, 900), branch=400) == [310, 400, 905]


def test_interval_only_for_prompts_without_structure_unless_asked() -> None:
    ours = SnapshotPolicy.named("ours", interval=128)
    assert ours.prompt_positions(0, 400, boundaries=(), branch=0) == [128, 256, 384, 400]
    assert ours.prompt_positions(0, 400, boundaries=(200,), branch=0) == [200, 400]
    fixed = SnapshotPolicy.named("interval", interval=128)
    assert fixed.prompt_positions(0, 400, boundaries=(200,), branch=150) == [128, 256, 384]


def test_exact_keeps_only_the_end_of_prompt_and_reply_together() -> None:
    exact = SnapshotPolicy.named("exact")
    assert exact.prompt_positions(0, 400, boundaries=(200,), branch=150) == []
    assert exact.reply_end and not exact.prompt_end and not exact.anywhere


def test_unknown_policy_and_negative_interval_are_refused() -> None:
    with pytest.raises(PolicyError, match="choose ours, interval or exact"):
        SnapshotPolicy.named("sometimes")
    with pytest.raises(PolicyError, match="interval"):
        SnapshotPolicy.named("ours", interval=-1)
