"""The callers' queue shared by the text scheduler and the media worker: round-robin order, bounds, removal."""

from __future__ import annotations

import pytest

from node.engine.caller_queue import CallerQueues, QueueFullError


def drain(queues: CallerQueues[str]) -> list[str]:
    order = []
    while queues:
        order.append(queues.pop())
    return order


def test_callers_take_turns_and_each_callers_items_keep_their_order() -> None:
    queues: CallerQueues[str] = CallerQueues(max_queue=10)
    for item in ("a1", "a2", "a3"):
        queues.push("alice", item)
    queues.push("bob", "b1")
    queues.push("carol", "c1")
    queues.push("bob", "b2")
    assert drain(queues) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert queues.waiting == 0


def test_a_full_queue_refuses_and_a_reserved_place_is_taken_without_a_check() -> None:
    queues: CallerQueues[str] = CallerQueues(max_queue=2)
    queues.push("alice", "a1")
    queues.reserve()
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        queues.push("bob", "b1")
    queues.push("bob", "b1", reserved=True)
    assert queues.waiting == 2
    with pytest.raises(QueueFullError):
        queues.check_room()


def test_removing_a_waiting_item_frees_its_place_and_an_item_already_taken_is_not_removed() -> None:
    queues: CallerQueues[str] = CallerQueues(max_queue=3)
    queues.push("alice", "a1")
    queues.push("alice", "a2")
    queues.push("bob", "b1")
    assert queues.pop() == "a1"
    assert not queues.remove("alice", "a1")
    assert queues.remove("alice", "a2")
    assert queues.waiting == 1
    assert drain(queues) == ["b1"]
    queues.reserve()
    queues.release()
    assert queues.waiting == 0
