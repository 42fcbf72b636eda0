"""An opening in flight: each layer waits for its own messages, and a failure is raised once, by `finish`."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from cache.opening import Opening, SealedEntryError
from cache.sealing import SealError


def done(error: Exception | None = None) -> Future[None]:
    future: Future[None] = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


def test_a_layer_waits_for_its_messages_then_places_its_rows_and_a_failure_is_raised_by_finish() -> None:
    failures, placed = [], []
    opening = Opening(lambda: failures.append(1))
    opening.add(0, 7, [done(), done()], lambda: placed.append(0))
    opening.add(1, 7, [done(SealError("tag")), done(SealError("tag"))], lambda: placed.append(1))
    opening.add(1, 9, [done()], lambda: placed.append(2))
    assert opening.layers == [0, 1]
    opening.wait(1)  # a failure is recorded, not raised: the forward reading the layer goes on
    assert placed == [1, 2] and failures == [1]  # one entry failed, counted once
    opening.wait(1)  # a second look at a layer waits for nothing
    assert placed == [1, 2] and opening.layers == [0]
    with pytest.raises(SealedEntryError) as failed:
        opening.finish()
    assert failed.value.handles == [7] and placed == [1, 2, 0] and opening.layers == []


def test_an_opening_that_opens_finishes_quietly() -> None:
    opening = Opening(lambda: None)
    opening.add(3, 1, [done()], lambda: None)
    opening.finish()
    assert opening.layers == []
