"""How many rounds the load-time measurement of sealing's cost times."""

from __future__ import annotations

from node.engine.seal_cost import CHEAP_ROUNDS_S, MAX_ROUNDS, ROUNDS, more_rounds


def test_cheap_rounds_go_on_until_their_time_or_the_limit_and_costly_ones_stop_at_two() -> None:
    assert (ROUNDS, MAX_ROUNDS, CHEAP_ROUNDS_S) == (2, 8, 0.05)
    assert more_rounds([]) and more_rounds([1.0])  # at least two, however long
    assert not more_rounds([0.2, 0.25])  # a large model: two rounds
    assert more_rounds([0.001] * 7) and not more_rounds([0.001] * 8)  # a small one: up to eight
    assert more_rounds([0.02, 0.02]) and not more_rounds([0.02, 0.02, 0.02])  # until 50 ms are spent
