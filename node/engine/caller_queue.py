"""Callers' waiting work, taken round-robin: each caller has its own FIFO, so one caller's burst cannot starve
another's single request, and the node holds at most `max_queue` waiting items in all.

Plain Python over opaque items, no locking of its own: its owner (the text `Scheduler`'s or the media worker's
condition) holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFullError(Exception):
    """The node has as many waiting requests as it is configured to hold."""


class CallerQueues(Generic[T]):
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        """caller -> its waiting items; the callers in rotation order, the next to be served first."""
        self.waiting = 0
        """Items queued plus places reserved (`reserve`) for items not yet queued."""

    def __bool__(self) -> bool:
        return bool(self._queues)

    def check_room(self) -> None:
        """Raise QueueFullError when an item queued now would be refused."""
        if self.waiting >= self.max_queue:
            raise QueueFullError(f"the node is busy: {self.waiting} requests are waiting; retry later")

    def reserve(self) -> None:
        """Hold a place for an item `push`ed later with `reserved=True`; raises QueueFullError when there is none."""
        self.check_room()
        self.waiting += 1

    def release(self) -> None:
        """Give back a place held by `reserve` that no item will take."""
        self.waiting -= 1

    def push(self, caller: str, item: T, reserved: bool = False) -> None:
        """Queue `item` at the back of `caller`'s FIFO; `reserved`: it takes a place `reserve` held."""
        if not reserved:
            self.reserve()
        self._queues.setdefault(caller, deque()).append(item)

    def pop(self) -> T:
        """The next caller's oldest item; that caller goes to the back of the rotation, or leaves it when drained."""
        caller, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        del self._queues[caller]
        if queue:
            self._queues[caller] = queue
        self.waiting -= 1
        return item

    def remove(self, caller: str, item: T) -> bool:
        """Take a waiting `item` out (its request was cancelled); False when it is not waiting (already popped)."""
        queue = self._queues.get(caller)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queues[caller]
        self.waiting -= 1
        return True
